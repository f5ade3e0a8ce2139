/**
 * What the Elastic jobs panel shows, as pure functions of the kernel's messages (no
 * JupyterLab imports, so they are unit-tested under plain Node).
 */

/** One row: a `%%elastic` job, or a session (workers that live across cells). */
export interface IItem {
  kind: 'job' | 'session';
  id: string;
  number: number;
  state: string;
  done: boolean;
  world_size: number;
  nnodes: number;
  nproc: number;
  restarts: number;
  max_restarts: number;
  started: number;
  elapsed: number;
  last_commit: { step: unknown; time: number } | null;
  cell_id: string | null;
  background: boolean;
  can_resize: boolean;
  min_nproc: number;
  max_nproc: number;
  root_cause: string | null;
  summary: string | null;
  cells?: number; // a session's: the cells it ran
  // a --launcher's allocations, as `%elastic status` shows them: "ID: state (reason) on WHERE"
  machines?: string[];
  // the world size over time and its marks (ui/charts.py's Charts.live), drawn by liveCharts
  chart?: unknown;
  // its dashboard's widget (model id), and whether the kernel holds its finished record
  widget?: string | null;
  has_record?: boolean;
}

/** A detached job of the user's on this machine that this kernel does not follow (a
 * `%%elastic --detach` cell of another kernel, or of this one before it restarted). */
export interface IDetached {
  id: string;
  title: string; // the cell's first line
  elapsed: number; // seconds since it started
  pid: number; // its agent's
}

/** One allocation line of a --launcher job, and its state for the eye (pending ones are
 * what people look for: the scheduler's reason says why they wait). */
export interface IAllocation {
  text: string;
  state: 'pending' | 'running' | 'ended' | 'leaving' | 'note';
}

/** Messages from the kernel (elastic_magic/notebook/comm.py). */
export type KernelMessage =
  | { type: 'items'; items: IItem[]; detached?: IDetached[] }
  | { type: 'finished'; item: IItem }
  | { type: 'stacks'; id: string; ranks: Record<string, string> }
  | { type: 'error'; id: string | null; text: string }
  | { type: 'record'; id: string; bundle: Record<string, unknown> };

/** Actions the panel sends; the kernel checks each (bounds, job still running). */
export type Action =
  | { action: 'stop'; id: string }
  | { action: 'scale'; id: string; nproc: number; now?: boolean }
  | { action: 'stacks'; id: string }
  | { action: 'record'; id: string }
  | { action: 'refresh' };

/** The one length-of-time format of elastic_magic (ui/describe.py's duration): 4.2s,
 * 2m 05s, 1h 02m. */
export function formatElapsed(seconds: number): string {
  const s = Math.max(0, seconds);
  if (s < 60) {
    return `${s.toFixed(1)}s`;
  }
  const pad = (n: number) => String(n).padStart(2, '0');
  const whole = Math.floor(s);
  if (whole < 3600) {
    return `${Math.floor(whole / 60)}m ${pad(whole % 60)}s`;
  }
  return `${Math.floor(whole / 3600)}h ${pad(Math.floor((whole % 3600) / 60))}m`;
}

export function plural(n: number, noun: string): string {
  return `${n} ${noun}${n === 1 ? '' : 's'}`;
}

/** A row's title: "#3 job", "#4 session". */
export function titleOf(item: IItem): string {
  return `#${item.number} ${item.kind}`;
}

/** The row's facts, in the order people scan them. */
export function describeItem(item: IItem): string[] {
  const facts = [
    item.state,
    `world size ${item.world_size}`,
    plural(Math.max(item.nnodes, 1), 'machine'),
    `restarts ${item.restarts}/${item.max_restarts}`,
    formatElapsed(item.elapsed)
  ];
  if (item.kind === 'session') {
    facts.push(`${plural(item.cells ?? 0, 'cell')} run`);
  }
  if (item.last_commit) {
    facts.push(`last commit: step ${String(item.last_commit.step)}`);
  }
  return facts;
}

/** The job's allocations, pending first (each keeps the kernel's wording); a line that is
 * not an allocation (the scheduler could not be asked) is a note. */
export function allocationsOf(item: IItem): IAllocation[] {
  const order = { pending: 0, running: 1, leaving: 2, ended: 3, note: 4 };
  return (item.machines ?? [])
    .map((text): IAllocation => {
      const state = /^\S+?: (pending|running|ended|leaving)\b/.exec(text)?.[1];
      return { text, state: (state as IAllocation['state'] | undefined) ?? 'note' };
    })
    .sort((a, b) => order[a.state] - order[b.state]);
}

/** A running job can be stopped and asked for its stacks; resized only within bounds. */
export function actionsFor(item: IItem): { stop: boolean; stacks: boolean; resize: boolean } {
  const live = !item.done;
  return { stop: live, stacks: live, resize: live && item.can_resize };
}

/** The status bar's text: the latest running item of the notebook, else nothing. */
export function statusText(items: IItem[]): string {
  const running = items.filter(i => !i.done);
  if (running.length === 0) {
    return '';
  }
  const latest = running.reduce((a, b) => (b.number > a.number ? b : a));
  const more = running.length > 1 ? ` (+${running.length - 1})` : '';
  const what = latest.kind === 'session' ? 'elastic session' : 'elastic';
  return `${what} #${latest.number}: ${latest.state}, world size ${latest.world_size}, ${formatElapsed(latest.elapsed)}${more}`;
}

/** What to tell people when a background job ends, led by the root cause of a failure. */
export function notificationFor(
  item: IItem
): { kind: 'success' | 'error' | 'info'; message: string } | null {
  if (!item.background) {
    return null; // its own cell shows the end
  }
  const name = `elastic job #${item.number}`;
  if (item.state === 'failed') {
    const cause = item.root_cause ? `: ${item.root_cause}` : '';
    return { kind: 'error', message: `${name} failed${cause}` };
  }
  if (item.state === 'succeeded') {
    return { kind: 'success', message: `${name} succeeded in ${formatElapsed(item.elapsed)}` };
  }
  return { kind: 'info', message: `${name} ${item.state} after ${formatElapsed(item.elapsed)}` };
}

/** A resize request from what was typed, or the reason it is refused. */
export function resizeRequest(item: IItem, typed: string): Action | string {
  const n = Number(typed);
  if (!Number.isInteger(n)) {
    return `how many workers? (a whole number, ${item.min_nproc} to ${item.max_nproc})`;
  }
  if (n < item.min_nproc || n > item.max_nproc) {
    return `this ${item.kind} runs between ${item.min_nproc} and ${item.max_nproc} workers`;
  }
  return { action: 'scale', id: item.id, nproc: n };
}

/** A detached job's facts, as the panel lists it. */
export function describeDetached(job: IDetached): string {
  return `${job.title} · running for ${formatElapsed(job.elapsed)} · agent pid ${job.pid}`;
}

/** The cell the panel's Attach runs: the job's dashboard then shows in it, as after
 * `%elastic attach` typed by hand. */
export function attachSource(job: IDetached): string {
  return `%elastic attach ${job.id}`;
}

/** A cell that runs as an elastic job: its first line is the %%elastic cell magic. */
export function isElasticCell(source: string): boolean {
  return /^\s*%%elastic(\s|$)/.test(source);
}

/** The MIME type of an output that shows a widget (its model id inside). */
export const WIDGET_VIEW = 'application/vnd.jupyter.widget-view+json';

/** Whether an output shows the dashboard ``widget``: after a page reload the kernel's swap
 * of that display for the record (an update of a display this page never saw) does not
 * reach it, so the extension asks for the record and puts it there itself. */
export function showsWidget(data: Record<string, unknown>, widget: string): boolean {
  const view = data[WIDGET_VIEW] as { model_id?: string } | undefined;
  return view?.model_id === widget;
}

/** The finished jobs whose records a page should ask for: those a cell still shows as their
 * widget (``shown``), asked once each. */
export function recordsToAsk(
  items: IItem[],
  shown: (item: IItem) => boolean,
  asked: Set<string>
): IItem[] {
  return items.filter(i => i.done && i.has_record && i.widget && !asked.has(i.id) && shown(i));
}
