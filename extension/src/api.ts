// Requests to the server extension (axon_nb.server), authenticated like every JupyterLab API.
import { URLExt } from '@jupyterlab/coreutils';
import { ServerConnection } from '@jupyterlab/services';

export interface MemoryRow {
  rank: number;
  used: number;
  total: number;
}

/** A resumed call's move of the run to another strategy, at the step it began from. */
export interface LayoutChange {
  step: number;
  from: string;
  to: string;
  seconds: number;
}

export interface RunState {
  name: string;
  strategy: string;
  state: 'running' | 'finished' | 'failed' | 'stopped' | 'interrupted';
  step: number;
  steps: number;
  eta_s: number | null;
  samples_per_s: number;
  losses: [number, number][];
  layout_changes?: LayoutChange[];
  failed_ranks: number[];
  stalled_ranks: number[];
  dashboard: Record<string, unknown> | null;
}

/** A detached cluster (its keeper publishes it): its name and who is attached. */
export interface DetachedState {
  name: string;
  attach: string;
  attached: number[];
}

export interface ClusterState {
  key: string;
  kernel_id: string;
  notebook: string | null;
  ranks: number;
  hosts: string[];
  devices: string[];
  backend: string | null;
  status: 'running' | 'stopped' | 'broken';
  memory: MemoryRow[];
  run: RunState | null;
  detached?: DetachedState;
}

export type Action = 'stop_run' | 'interrupt' | 'restart' | 'stop_cluster';

async function request(path: string[], init: RequestInit = {}): Promise<Response> {
  const settings = ServerConnection.makeSettings();
  const url = URLExt.join(settings.baseUrl, 'axon-nb', 'clusters', ...path);
  const response = await ServerConnection.makeRequest(url, init, settings);
  if (!response.ok) {
    let message = response.statusText;
    try {
      message = (await response.json()).message ?? message;
    } catch {
      // not JSON: keep the status text
    }
    throw new Error(message);
  }
  return response;
}

/** Every live cluster of this server's kernels. */
export async function listClusters(): Promise<ClusterState[]> {
  const response = await request([]);
  return (await response.json()).clusters as ClusterState[];
}

/** Ask a cluster's kernel to stop the run, interrupt, restart or stop the cluster. */
export async function control(key: string, action: Action): Promise<void> {
  await request([key, action], { method: 'POST', body: '' });
}
