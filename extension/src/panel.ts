// The "Axon" sidebar: every cluster of this server's kernels, its run, and the controls.
import { Clipboard } from '@jupyterlab/apputils';
import { Widget } from '@lumino/widgets';

import { Action, ClusterState, DetachedState, LayoutChange, RunState } from './api';
import { LABELS, confirmAndSend } from './confirm';
import { bytes, el, seconds, sparkline } from './format';
import { ClusterPoller } from './poller';

export class AxonPanel extends Widget {
  constructor(
    private readonly _poller: ClusterPoller,
    private readonly _openDashboard: (key: string) => void,
    private readonly _insertCell: () => void
  ) {
    super();
    this.id = 'axon-nb-sidebar';
    this.addClass('axon-nb-panel');
    this.title.label = 'Axon';
    this.title.caption = 'Axon: clusters and training runs';
    _poller.changed.connect(this._render, this);
    this._render();
  }

  private _render(): void {
    const clusters = this._poller.clusters;
    const insert = el('button', { class: 'jp-mod-styled axon-nb-insert' }, ['Insert %axon_cluster cell']);
    insert.addEventListener('click', () => this._insertCell());
    const children: (Node | string)[] = [el('h2', {}, ['Axon clusters']), insert];
    if (this._poller.error) {
      children.push(el('div', { class: 'axon-nb-error' }, [this._poller.error]));
    }
    if (!clusters.length) {
      children.push(el('p', { class: 'axon-nb-empty' }, ['No clusters. Start one with %axon_cluster 2 in a notebook.']));
    }
    children.push(...clusters.map(c => this._cluster(c)));
    this.node.replaceChildren(...children);
  }

  private _cluster(c: ClusterState): HTMLElement {
    const devices = [...new Set(c.devices)].join(', ') || '–';
    const title = c.detached
      ? `detached · ${c.detached.name}`
      : c.notebook
        ? c.notebook.split('/').pop() ?? c.notebook
        : `kernel ${c.kernel_id.slice(0, 8)}`;
    const box = el('section', { class: 'axon-nb-cluster', 'data-key': c.key }, [
      el('div', { class: 'axon-nb-title', title: c.notebook ?? c.kernel_id }, [title]),
      el('div', { class: 'axon-nb-meta' }, [
        `${c.ranks} ranks · ${c.hosts.join(', ') || '–'} · ${devices} · ${c.backend ?? '–'} · `,
        el('span', { class: `axon-nb-status axon-nb-${c.status}` }, [c.status])
      ]),
      this._memory(c)
    ]);
    if (c.detached) {
      box.append(this._attach(c.detached));
    }
    if (c.run) {
      box.append(this._run(c.key, c.run));
    }
    box.append(this._buttons(c));
    return box;
  }

  /** A detached cluster: who is attached, and the line that attaches a notebook to it. */
  private _attach(d: DetachedState): HTMLElement {
    const copy = el('button', { class: 'jp-mod-styled axon-nb-copy-attach', title: 'Copy to the clipboard' }, ['Copy']);
    copy.addEventListener('click', () => Clipboard.copyToSystem(d.attach));
    const who = d.attached.length ? `attached: kernel ${d.attached.join(', ')}` : 'no kernel attached';
    return el('div', { class: 'axon-nb-detached' }, [
      el('div', { class: 'axon-nb-meta' }, [who]),
      el('code', { class: 'axon-nb-attach' }, [d.attach]),
      copy
    ]);
  }

  private _memory(c: ClusterState): HTMLElement {
    const rows = c.memory.map(m =>
      el('div', { class: 'axon-nb-row' }, [
        el('span', { class: 'axon-nb-label' }, [`rank ${m.rank}`]),
        el('div', { class: 'axon-nb-bar' }, [
          el('div', { class: 'axon-nb-bar-used', style: `width:${m.total ? (100 * m.used) / m.total : 0}%` })
        ]),
        el('span', { class: 'axon-nb-value' }, [`${bytes(m.used)} / ${bytes(m.total)} peak`])
      ])
    );
    return el('div', { class: 'axon-nb-memory' }, rows);
  }

  private _run(key: string, run: RunState): HTMLElement {
    const share = run.steps ? Math.min(1, run.step / run.steps) : 0;
    const trouble: string[] = [];
    if (run.failed_ranks.length) {
      trouble.push(`failed: ranks ${run.failed_ranks.join(', ')}`);
    }
    if (run.stalled_ranks.length) {
      trouble.push(`stalled: ranks ${run.stalled_ranks.join(', ')}`);
    }
    const changes = run.layout_changes ?? [];
    const open = el('button', { class: 'jp-mod-styled axon-nb-open' }, ['Open dashboard']);
    open.addEventListener('click', () => this._openDashboard(key));
    return el('div', { class: 'axon-nb-run', 'data-step': String(run.step), 'data-state': run.state }, [
      el('div', {}, [el('strong', {}, [run.name]), ` · ${run.strategy} · ${run.state}`]),
      el('div', { class: 'axon-nb-bar' }, [el('div', { class: 'axon-nb-bar-progress', style: `width:${100 * share}%` })]),
      el('div', { class: 'axon-nb-meta' }, [
        `step ${run.step} / ${run.steps} · ETA ${run.state === 'running' ? seconds(run.eta_s) : 'done'} · ` +
          `${Math.round(run.samples_per_s)} samples/s`
      ]),
      sparkline(run.losses, changes.map(c => ({ step: c.step, title: moved(c) }))),
      ...(changes.length ? [this._layoutChanges(changes)] : []),
      ...(trouble.length ? [el('div', { class: 'axon-nb-error' }, [trouble.join(' · ')])] : []),
      ...(run.dashboard ? [open] : []) // (a detached cluster's keeper has no dashboard: attach)
    ]);
  }

  /** The run's layout now and since when, e.g. "FSDP() since step 5 (was DDP())". */
  private _layoutChanges(changes: LayoutChange[]): HTMLElement {
    const last = changes[changes.length - 1];
    return el('div', { class: 'axon-nb-layout', 'data-step': String(last.step), title: changes.map(moved).join('\n') }, [
      `${last.to} since step ${last.step} (was ${last.from})`
    ]);
  }

  private _buttons(c: ClusterState): HTMLElement {
    // a detached cluster's keeper stops runs and the cluster; restarting needs a kernel
    const actions: Action[] = c.detached
      ? ['stop_run', 'interrupt', 'stop_cluster']
      : ['stop_run', 'interrupt', 'restart', 'stop_cluster'];
    const buttons = actions.map(action => {
      const button = el('button', { class: 'jp-mod-styled axon-nb-control', 'data-action': action }, [LABELS[action]]);
      if (action === 'stop_run' && c.run?.state !== 'running') {
        button.setAttribute('disabled', '');
      }
      button.addEventListener('click', () => void confirmAndSend(c.key, action));
      return button;
    });
    return el('div', { class: 'axon-nb-controls' }, buttons);
  }
}

function moved(c: LayoutChange): string {
  return `${c.from} → ${c.to} at step ${c.step} (moved in ${seconds(c.seconds)})`;
}
