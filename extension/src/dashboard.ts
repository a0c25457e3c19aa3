// A run's full dashboard in a main-area tab: the notebook widget's own view
// (axon_nb/widgets/_dashboard.js), driven by the state the sidebar polls.
import { MainAreaWidget } from '@jupyterlab/apputils';
import { Widget } from '@lumino/widgets';

// The one source of the dashboard's view, shared with the notebook widget.
import view from '../../axon_nb/widgets/_dashboard.js';
import { ClusterPoller } from './poller';

type Callback = (value?: unknown) => void;

/** What the view needs of an anywidget model: get, and change events. */
class SnapshotModel {
  state: Record<string, unknown> = {};

  get(name: string): unknown {
    return this.state[name];
  }

  on(event: string, callback: Callback): void {
    (this._callbacks[event] ??= []).push(callback);
  }

  update(state: Record<string, unknown>): void {
    this.state = state;
    for (const [event, callbacks] of Object.entries(this._callbacks)) {
      if (event.startsWith('change:')) {
        callbacks.forEach(cb => cb());
      }
    }
  }

  private _callbacks: Record<string, Callback[]> = {};
}

export function dashboardTab(poller: ClusterPoller, key: string): MainAreaWidget {
  const content = new Widget();
  content.addClass('axon-nb-dashboard-tab');
  const model = new SnapshotModel();
  const first = poller.find(key)?.run?.dashboard;
  if (first) {
    model.state = first;
  }
  const widget = new MainAreaWidget({ content });
  widget.id = `axon-nb-dashboard-${key}`;
  widget.title.label = `Axon: ${poller.find(key)?.run?.name ?? key}`;
  widget.title.closable = true;
  if (first) {
    view.render({ model, el: content.node });
  } else {
    content.node.textContent = 'This cluster has no run yet.';
  }
  const refresh = () => {
    const run = poller.find(key)?.run;
    if (run?.dashboard) {
      model.update(run.dashboard);
    }
  };
  poller.changed.connect(refresh);
  widget.disposed.connect(() => poller.changed.disconnect(refresh));
  return widget;
}
