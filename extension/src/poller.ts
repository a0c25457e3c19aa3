// Polls the server once a second and tells the views what changed.
import { ISignal, Signal } from '@lumino/signaling';

import { ClusterState, listClusters } from './api';

export const POLL_MS = 1000;

export class ClusterPoller {
  clusters: ClusterState[] = [];
  error: string | null = null;

  get changed(): ISignal<this, void> {
    return this._changed;
  }

  start(): void {
    if (this._timer === null) {
      void this.refresh();
      this._timer = window.setInterval(() => void this.refresh(), POLL_MS);
    }
  }

  dispose(): void {
    if (this._timer !== null) {
      window.clearInterval(this._timer);
      this._timer = null;
    }
  }

  find(key: string): ClusterState | undefined {
    return this.clusters.find(c => c.key === key);
  }

  async refresh(): Promise<void> {
    try {
      this.clusters = await listClusters();
      this.error = null;
    } catch (e) {
      this.error = (e as Error).message;
    }
    this._changed.emit();
  }

  private _timer: number | null = null;
  private _changed = new Signal<this, void>(this);
}
