import { Message } from '@lumino/messaging';
import { Widget } from '@lumino/widgets';
import uPlot from 'uplot';

// The live charts' one implementation, shared with the dashboard widget (plain JS there).
// @ts-expect-error: a JS module without types, checked by its own browser tests
import { liveCharts } from '../../elastic_magic/ui/live_charts.js';

import { KernelChannel } from './channel';
import {
  actionsFor,
  allocationsOf,
  describeDetached,
  describeItem,
  IDetached,
  IItem,
  resizeRequest,
  titleOf
} from './model';

/** What liveCharts gives back: it draws the kernel's Charts.live() into its box. */
interface ILiveCharts {
  update(chart: unknown): void;
  destroy(): void;
}

/** A row's chart: its box outlives the row's redraws (the chart is not made anew). */
interface IRowChart {
  box: HTMLDivElement;
  charts: ILiveCharts;
}

/** Where a row's "cell" link leads: the notebook scrolls to the cell that started the job. */
export type CellLink = (cellId: string) => void;

/** What a detached job's Attach does: run `%elastic attach RUN_ID` in a new cell. */
export type AttachInCell = (job: IDetached) => void;

/** Seconds between the panel's looks at the detached jobs while it is shown (they start and
 * end in other kernels, which tell this one nothing). */
const LOOK_EVERY = 5;

/** The "Elastic jobs" side panel: the current notebook's jobs, newest first. */
export class ElasticPanel extends Widget {
  private channel: KernelChannel | null = null;
  private goToCell: CellLink = () => undefined;
  private attachInCell: AttachInCell = () => undefined;
  private looking: number | null = null; // the timer of the looks, while shown
  private attaching = new Set<string>(); // detached jobs whose Attach was clicked
  private typed = new Map<string, string>(); // resize boxes, kept across re-renders
  private charts = new Map<string, IRowChart>(); // job id -> its world size chart

  constructor() {
    super();
    this.id = 'elastic-magic-jobs';
    this.title.label = 'Elastic jobs';
    this.title.caption = 'elastic_magic jobs of this notebook\'s kernel';
    this.addClass('em-panel');
    this.render();
  }

  show_(channel: KernelChannel | null, goToCell: CellLink, attachInCell: AttachInCell): void {
    const changed = channel !== this.channel;
    this.channel = channel;
    this.goToCell = goToCell;
    this.attachInCell = attachInCell;
    this.render();
    if (changed && this.isVisible) {
      this.look();
    }
  }

  protected onAfterShow(msg: Message): void {
    super.onAfterShow(msg);
    this.look();
    if (this.looking === null) {
      this.looking = window.setInterval(() => this.look(), LOOK_EVERY * 1000);
    }
  }

  protected onBeforeHide(msg: Message): void {
    this.stopLooking();
    super.onBeforeHide(msg);
  }

  dispose(): void {
    this.stopLooking();
    super.dispose();
  }

  private stopLooking(): void {
    if (this.looking !== null) {
      window.clearInterval(this.looking);
      this.looking = null;
    }
  }

  /** Ask the kernel for the list again (detached jobs included), where it answers now. */
  private look(): void {
    if (this.channel?.responsive) {
      this.channel.send({ action: 'refresh' });
    }
  }

  render(): void {
    const root = this.node;
    if (root.contains(document.activeElement) && document.activeElement?.tagName === 'INPUT') {
      return; // someone is typing a size: the next update redraws
    }
    root.textContent = '';
    const heading = document.createElement('h2');
    heading.textContent = 'Elastic jobs';
    root.appendChild(heading);
    const items = [...(this.channel?.items ?? [])].sort((a, b) => b.number - a.number);
    const detached = this.channel?.detached ?? [];
    const listed = new Set(detached.map(job => job.id));
    this.attaching.forEach(id => listed.has(id) || this.attaching.delete(id));
    if (detached.length > 0) {
      root.appendChild(this.detachedList(detached));
    }
    if (items.length === 0) {
      const empty = document.createElement('p');
      empty.className = 'em-panel-empty';
      empty.textContent = this.channel
        ? 'No elastic jobs or sessions in this kernel yet.'
        : 'Open a notebook that ran %load_ext elastic_magic.';
      root.appendChild(empty);
      this.dropCharts(new Set());
      return;
    }
    for (const item of items) {
      root.appendChild(this.row(item));
    }
    // Drawn once on the page: a chart takes the theme's colours from where it is.
    for (const item of items) {
      this.charts.get(item.id)?.charts.update(item.chart);
    }
    this.dropCharts(new Set(items.map(item => item.id)));
  }

  /** The user's detached jobs that this kernel does not follow, each with its Attach. */
  private detachedList(jobs: IDetached[]): HTMLElement {
    const list = document.createElement('section');
    list.className = 'em-panel-detached';
    const heading = document.createElement('h3');
    heading.textContent = 'Detached jobs on this machine';
    heading.title = 'running in agents of their own; Attach follows one in a new cell below the active one';
    list.appendChild(heading);
    for (const job of jobs) {
      const row = document.createElement('div');
      row.className = 'em-panel-row em-panel-detached-row';
      row.dataset.emJob = job.id;
      const title = document.createElement('div');
      title.className = 'em-panel-title';
      title.textContent = job.id;
      row.appendChild(title);
      const facts = document.createElement('div');
      facts.className = 'em-panel-facts';
      facts.textContent = describeDetached(job);
      row.appendChild(facts);
      const actions = document.createElement('div');
      actions.className = 'em-panel-actions';
      const attach = this.button('Attach', 'em-panel-attach', () => {
        this.attaching.add(job.id); // one cell: the row goes once the kernel follows it
        this.attachInCell(job);
        this.render();
      });
      attach.disabled = this.attaching.has(job.id);
      actions.appendChild(attach);
      row.appendChild(actions);
      list.appendChild(row);
    }
    return list;
  }

  /** The box of the row's world size over time, with the marks of its restarts and
   * resizes (drawn by render once the row is on the page). */
  private chart(item: IItem): HTMLElement | null {
    if (!item.chart) {
      return null;
    }
    let chart = this.charts.get(item.id);
    if (!chart) {
      const box = document.createElement('div');
      box.className = 'em-panel-chart';
      const charts = liveCharts(uPlot, box, { height: 96, compact: true }) as ILiveCharts;
      chart = { box, charts };
      this.charts.set(item.id, chart);
    }
    return chart.box;
  }

  private dropCharts(keep: Set<string>): void {
    for (const [id, chart] of this.charts) {
      if (!keep.has(id)) {
        chart.charts.destroy();
        this.charts.delete(id);
      }
    }
  }

  private row(item: IItem): HTMLElement {
    const row = document.createElement('div');
    row.className = `em-panel-row em-state-${item.state}`;
    row.dataset.emJob = item.id;
    row.dataset.emKind = item.kind;
    const title = document.createElement('div');
    title.className = 'em-panel-title';
    title.textContent = titleOf(item);
    if (item.cell_id) {
      const link = document.createElement('a');
      link.className = 'em-panel-cell';
      link.textContent = 'go to cell';
      link.href = '#';
      link.onclick = event => {
        event.preventDefault();
        this.goToCell(item.cell_id!);
      };
      title.appendChild(link);
    }
    row.appendChild(title);
    const facts = document.createElement('div');
    facts.className = 'em-panel-facts';
    facts.textContent = describeItem(item).join(' · ');
    row.appendChild(facts);
    const allocations = allocationsOf(item);
    if (allocations.length > 0) {
      const list = document.createElement('ul');
      list.className = 'em-panel-machines';
      list.title = "the launcher's allocations; those that wait say why, in the scheduler's words";
      for (const allocation of allocations) {
        const line = document.createElement('li');
        line.className = `em-alloc em-alloc-${allocation.state}`;
        line.textContent = allocation.text;
        list.appendChild(line);
      }
      row.appendChild(list);
    }
    const chart = this.chart(item);
    if (chart) {
      row.appendChild(chart);
    }
    if (item.root_cause) {
      const cause = document.createElement('div');
      cause.className = 'em-panel-cause';
      cause.textContent = `root cause: ${item.root_cause}`;
      row.appendChild(cause);
    }
    const can = actionsFor(item);
    const actions = document.createElement('div');
    actions.className = 'em-panel-actions';
    if (can.stop) {
      actions.appendChild(this.button('Stop', 'em-panel-stop', () =>
        this.channel?.send({ action: 'stop', id: item.id })));
    }
    if (can.stacks) {
      actions.appendChild(this.button('Stacks', 'em-panel-stacks', () =>
        this.channel?.send({ action: 'stacks', id: item.id })));
    }
    if (can.resize) {
      const input = document.createElement('input');
      input.type = 'number';
      input.className = 'em-panel-nproc';
      input.min = String(item.min_nproc);
      input.max = String(item.max_nproc);
      input.value = this.typed.get(item.id) ?? String(item.nproc || item.world_size);
      input.oninput = () => this.typed.set(item.id, input.value);
      actions.appendChild(input);
      actions.appendChild(this.button('Resize', 'em-panel-resize', () => {
        const request = resizeRequest(item, input.value);
        if (typeof request === 'string') {
          this.channel?.errors.set(item.id, request);
          this.render();
        } else {
          this.channel?.errors.delete(item.id);
          this.channel?.send(request);
          this.render();
        }
      }));
    }
    row.appendChild(actions);
    const error = this.channel?.errors.get(item.id);
    if (error) {
      const note = document.createElement('div');
      note.className = 'em-panel-error';
      note.textContent = error;
      row.appendChild(note);
    }
    const stacks = this.channel?.stacks.get(item.id);
    if (stacks) {
      const pre = document.createElement('pre');
      pre.className = 'em-panel-stack-text';
      pre.textContent = Object.entries(stacks)
        .map(([rank, text]) => `==> rank ${rank} <==\n${text}`)
        .join('\n');
      row.appendChild(pre);
    }
    return row;
  }

  private button(label: string, cls: string, onClick: () => void): HTMLButtonElement {
    const button = document.createElement('button');
    button.className = `jp-Button ${cls}`;
    button.textContent = label;
    button.onclick = onClick;
    return button;
  }
}
