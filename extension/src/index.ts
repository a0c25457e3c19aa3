// The Axon JupyterLab extension: a sidebar of every notebook's clusters and runs, their
// controls, a run's dashboard in a tab, a status bar item and command-palette entries.
import {
  ILayoutRestorer,
  JupyterFrontEnd,
  JupyterFrontEndPlugin
} from '@jupyterlab/application';
import { ICommandPalette } from '@jupyterlab/apputils';
import { INotebookTracker, NotebookActions } from '@jupyterlab/notebook';
import { IStatusBar } from '@jupyterlab/statusbar';

import { Action } from './api';
import { LABELS, confirmAndSend } from './confirm';
import { dashboardTab } from './dashboard';
import { AxonPanel } from './panel';
import { ClusterPoller } from './poller';
import { AxonStatus } from './statusbar';

const CATEGORY = 'Axon';
const COMMANDS = {
  open: 'axon-nb:open-sidebar',
  insert: 'axon-nb:insert-cluster-cell',
  dashboard: 'axon-nb:open-dashboard'
};

const plugin: JupyterFrontEndPlugin<void> = {
  id: 'axon-nb:plugin',
  description: 'Clusters and training runs of every notebook, with controls.',
  autoStart: true,
  optional: [ICommandPalette, ILayoutRestorer, INotebookTracker, IStatusBar],
  activate: (
    app: JupyterFrontEnd,
    palette: ICommandPalette | null,
    restorer: ILayoutRestorer | null,
    notebooks: INotebookTracker | null,
    statusBar: IStatusBar | null
  ) => {
    const poller = new ClusterPoller();
    const openDashboard = (key: string) => {
      const tab = dashboardTab(poller, key);
      app.shell.add(tab, 'main');
      app.shell.activateById(tab.id);
    };
    const insertCell = () => {
      const panel = notebooks?.currentWidget;
      if (!panel) {
        return;
      }
      NotebookActions.insertBelow(panel.content);
      const cell = panel.content.activeCell;
      cell?.model.sharedModel.setSource('%load_ext axon_nb\n%axon_cluster 2');
    };
    const sidebar = new AxonPanel(poller, openDashboard, insertCell);
    app.shell.add(sidebar, 'left', { rank: 900 });
    restorer?.add(sidebar, 'axon-nb-sidebar');
    poller.start();

    const first = () => poller.clusters[0]?.key;
    app.commands.addCommand(COMMANDS.open, {
      label: 'Show Axon Clusters',
      execute: () => app.shell.activateById(sidebar.id)
    });
    app.commands.addCommand(COMMANDS.insert, {
      label: 'Insert %axon_cluster Cell',
      isEnabled: () => !!notebooks?.currentWidget,
      execute: insertCell
    });
    app.commands.addCommand(COMMANDS.dashboard, {
      label: 'Open Axon Run Dashboard',
      isEnabled: () => !!poller.clusters.find(c => c.run),
      execute: args => {
        const key = (args.key as string) ?? poller.clusters.find(c => c.run)?.key;
        if (key) {
          openDashboard(key);
        }
      }
    });
    const actions: Action[] = ['stop_run', 'interrupt', 'restart', 'stop_cluster'];
    for (const action of actions) {
      app.commands.addCommand(`axon-nb:${action.replace('_', '-')}`, {
        label: `Axon: ${LABELS[action]}`,
        isEnabled: () => !!first(),
        execute: args => {
          const key = (args.key as string) ?? first();
          return key ? confirmAndSend(key, action) : undefined;
        }
      });
    }
    if (palette) {
      for (const command of [
        ...Object.values(COMMANDS),
        ...actions.map(a => `axon-nb:${a.replace('_', '-')}`)
      ]) {
        palette.addItem({ command, category: CATEGORY });
      }
    }
    if (statusBar) {
      statusBar.registerStatusItem('axon-nb:status', {
        item: new AxonStatus(poller),
        align: 'left',
        rank: 50
      });
    }
  }
};

export default plugin;
