import {
  ILabShell,
  JupyterFrontEnd,
  JupyterFrontEndPlugin
} from '@jupyterlab/application';
import { Notification } from '@jupyterlab/apputils';
import { IEditorLanguageRegistry } from '@jupyterlab/codemirror';
import { INotebookTracker, NotebookActions, NotebookPanel } from '@jupyterlab/notebook';
import { IStatusBar } from '@jupyterlab/statusbar';
import { Widget } from '@lumino/widgets';

import { KernelChannel } from './channel';
import {
  attachSource,
  IDetached,
  IItem,
  isElasticCell,
  notificationFor,
  recordsToAsk,
  showsWidget,
  statusText
} from './model';
import { ElasticPanel } from './panel';

/** %%elastic cells are Python: a language of their own, IPython's highlighting (Python
 * with builtins), whatever mode the notebook gives other cells or cell magics. */
const ELASTIC_MIME = 'text/x-elastic-python';

/** What the extension uses of a code cell's outputs (@jupyterlab/outputarea's model). */
interface IOutputList {
  readonly length: number;
  get(index: number): { data: unknown };
  set(
    index: number,
    output: { output_type: 'display_data'; data: Record<string, unknown>; metadata: object }
  ): void;
}

function registerLanguage(languages: IEditorLanguageRegistry): void {
  languages.addLanguage({
    name: 'elastic-python',
    displayName: 'Python (%%elastic)',
    mime: ELASTIC_MIME,
    load: async () => {
      const python =
        (await languages.getLanguage('ipython')) ?? (await languages.getLanguage('python'));
      if (!python?.support) {
        throw new Error('the Python language is not available');
      }
      return python.support;
    }
  });
}

/** Keep every %%elastic cell of a notebook highlighted as Python while it is edited. */
function highlightElasticCells(panel: NotebookPanel): void {
  const update = () => {
    for (const cell of panel.content.widgets) {
      if (cell.model.type !== 'code') {
        continue;
      }
      const elastic = isElasticCell(cell.model.sharedModel.getSource());
      if (elastic && cell.model.mimeType !== ELASTIC_MIME) {
        cell.model.mimeType = ELASTIC_MIME;
      } else if (!elastic && cell.model.mimeType === ELASTIC_MIME) {
        cell.model.mimeType = panel.content.codeMimetype;
      }
    }
  };
  panel.context.ready.then(update);
  panel.content.model?.contentChanged.connect(update);
  panel.content.modelContentChanged.connect(update);
}

const plugin: JupyterFrontEndPlugin<void> = {
  id: 'elastic-magic:plugin',
  description: 'The Elastic jobs panel, status bar item and notifications for elastic_magic',
  autoStart: true,
  requires: [INotebookTracker],
  optional: [ILabShell, IStatusBar, IEditorLanguageRegistry],
  activate: (
    app: JupyterFrontEnd,
    tracker: INotebookTracker,
    labShell: ILabShell | null,
    statusBar: IStatusBar | null,
    languages: IEditorLanguageRegistry | null
  ) => {
    const channels = new Map<string, KernelChannel>(); // by kernel id
    const panel = new ElasticPanel();
    panel.title.iconClass = 'em-panel-icon';
    app.shell.add(panel, labShell ? 'right' : 'left', { rank: 900 });

    const status = new Widget();
    status.addClass('em-status');
    status.node.dataset.em = 'status';
    status.node.title = 'elastic_magic: the running job of this notebook (click for the panel)';
    status.node.onclick = () => app.shell.activateById(panel.id);

    const channelOf = (nb: NotebookPanel | null): KernelChannel | null => {
      const kernel = nb?.sessionContext.session?.kernel;
      return kernel ? channels.get(kernel.id) ?? null : null;
    };

    const goToCell = (nb: NotebookPanel) => (cellId: string) => {
      const index = nb.content.widgets.findIndex(c => c.model.id === cellId);
      if (index < 0) {
        Notification.warning('That cell is no longer in this notebook.', { autoClose: 4000 });
        return;
      }
      app.shell.activateById(nb.id);
      nb.content.activeCellIndex = index;
      void nb.content.scrollToItem(index, 'center');
    };

    /** Attach: a new cell below the active one runs `%elastic attach RUN_ID`; the job's
     * dashboard shows there (and is saved with the notebook), as when typed by hand. */
    const attachInCell = (nb: NotebookPanel) => (job: IDetached) => {
      app.shell.activateById(nb.id);
      NotebookActions.insertBelow(nb.content);
      nb.content.activeCell?.model.sharedModel.setSource(attachSource(job));
      void NotebookActions.run(nb.content, nb.sessionContext);
    };

    const refresh = () => {
      const nb = tracker.currentWidget;
      panel.show_(channelOf(nb), nb ? goToCell(nb) : () => undefined,
                  nb ? attachInCell(nb) : () => undefined);
      status.node.textContent = statusText(channelOf(nb)?.items ?? []);
      tracker.forEach(placeRecords);
    };

    /** Where a reload lost a finished job's swap of its dashboard for its record: ask the
     * kernel for the record, and put it in the widget's place (the notebook then saves it). */
    const placeRecords = (nb: NotebookPanel) => {
      const channel = channelOf(nb);
      if (!channel) {
        return;
      }
      const widgetOutputs = (item: IItem) => {
        const found: { outputs: IOutputList; i: number }[] = [];
        for (const cell of nb.content.widgets) {
          if (cell.model.type !== 'code' || (item.cell_id && cell.model.id !== item.cell_id)) {
            continue;
          }
          const outputs = (cell.model as unknown as { outputs: IOutputList }).outputs;
          for (let i = 0; i < outputs.length; i++) {
            if (showsWidget(outputs.get(i).data as Record<string, unknown>, item.widget ?? '')) {
              found.push({ outputs, i });
            }
          }
        }
        return found;
      };
      for (const item of recordsToAsk(channel.items, i => widgetOutputs(i).length > 0, channel.asked)) {
        channel.asked.add(item.id);
        channel.send({ action: 'record', id: item.id });
      }
      for (const [id, bundle] of channel.records) {
        const item = channel.items.find(i => i.id === id);
        const places = item ? widgetOutputs(item) : [];
        for (const { outputs, i } of places) {
          outputs.set(i, { output_type: 'display_data', data: bundle, metadata: {} });
        }
        if (places.length > 0) {
          channel.records.delete(id); // kept for another notebook of the kernel until placed
        }
      }
    };

    const announce = (item: IItem) => {
      const note = notificationFor(item);
      if (note) {
        Notification.emit(note.message, note.kind, { autoClose: note.kind === 'error' ? false : 8000 });
      }
    };

    const connect = (nb: NotebookPanel) => {
      const watch = () => {
        const kernel = nb.sessionContext.session?.kernel;
        if (kernel && !channels.has(kernel.id)) {
          channels.set(kernel.id, new KernelChannel(kernel, refresh, announce));
          kernel.disposed.connect(() => {
            channels.get(kernel.id)?.dispose();
            channels.delete(kernel.id);
            refresh();
          });
        }
        refresh();
      };
      nb.sessionContext.kernelChanged.connect(watch);
      void nb.sessionContext.ready.then(watch);
      highlightElasticCells(nb);
    };

    if (languages) {
      registerLanguage(languages);
    }
    tracker.widgetAdded.connect((_, nb) => connect(nb));
    tracker.forEach(connect);
    tracker.currentChanged.connect(refresh);
    if (statusBar) {
      statusBar.registerStatusItem('elastic-magic:status', {
        item: status,
        align: 'left',
        rank: 4,
        isActive: () => true // empty, it takes no room; no signal needed as jobs come and go
      });
    }
    refresh();
  }
};

export default plugin;
