// The controls, each confirmed where it loses work.
import { Dialog, showDialog, showErrorMessage } from '@jupyterlab/apputils';

import { Action, control } from './api';

export const LABELS: Record<Action, string> = {
  stop_run: 'Stop run',
  interrupt: 'Interrupt',
  restart: 'Restart cluster',
  stop_cluster: 'Stop cluster'
};

const WHY: Record<Action, string> = {
  stop_run: 'Every rank stops at the same step boundary; the model stays on the ranks and the run can be resumed.',
  interrupt: 'Interrupts whatever the ranks are running (Ctrl-C on every rank).',
  restart: 'Stops every rank and starts fresh ones: the models, optimizers and runs on the ranks are lost.',
  stop_cluster: 'Stops every rank and frees its GPUs: the models, optimizers and runs on the ranks are lost.'
};

/** Ask, then send ``action`` to cluster ``key``; false when the user declined. */
export async function confirmAndSend(key: string, action: Action): Promise<boolean> {
  const answer = await showDialog({
    title: `${LABELS[action]}?`,
    body: WHY[action],
    buttons: [Dialog.cancelButton(), Dialog.warnButton({ label: LABELS[action] })]
  });
  if (!answer.button.accept) {
    return false;
  }
  try {
    await control(key, action);
  } catch (e) {
    await showErrorMessage(`${LABELS[action]} failed`, (e as Error).message);
    return false;
  }
  return true;
}
