// The status bar item: ranks and the progress of the newest running run.
import { Widget } from '@lumino/widgets';

import { ClusterPoller } from './poller';

export class AxonStatus extends Widget {
  constructor(private readonly _poller: ClusterPoller) {
    super();
    this.addClass('axon-nb-statusbar');
    _poller.changed.connect(this._render, this);
    this._render();
  }

  private _render(): void {
    const clusters = this._poller.clusters;
    if (!clusters.length) {
      this.node.textContent = 'Axon: no clusters';
      return;
    }
    const ranks = clusters.reduce((n, c) => n + c.ranks, 0);
    const run = clusters.map(c => c.run).find(r => r?.state === 'running');
    const progress = run ? ` · ${run.name} ${run.step}/${run.steps}` : '';
    this.node.textContent = `Axon: ${clusters.length} cluster${clusters.length > 1 ? 's' : ''}, ${ranks} ranks${progress}`;
  }
}
