import {
  actionsFor,
  allocationsOf,
  attachSource,
  describeDetached,
  describeItem,
  formatElapsed,
  IItem,
  isElasticCell,
  notificationFor,
  recordsToAsk,
  resizeRequest,
  showsWidget,
  statusText,
  titleOf,
  WIDGET_VIEW
} from '../model';

function item(over: Partial<IItem> = {}): IItem {
  return {
    kind: 'job', id: 'em-1', number: 1, state: 'running', done: false, world_size: 2,
    nnodes: 1, nproc: 2, restarts: 0, max_restarts: 1, started: 0, elapsed: 75,
    last_commit: null, cell_id: 'c1', background: true, can_resize: true, min_nproc: 1,
    max_nproc: 4, root_cause: null, summary: null, ...over
  };
}

describe('formatElapsed', () => {
  it('uses the one format of elastic_magic: 4.2s, 2m 05s, 1h 02m', () => {
    expect(formatElapsed(4.25)).toBe('4.3s');
    expect(formatElapsed(125)).toBe('2m 05s');
    expect(formatElapsed(3725)).toBe('1h 02m');
  });
});

describe('describeItem', () => {
  it('lists state, size, machines, restarts, elapsed and the last commit', () => {
    expect(describeItem(item({ last_commit: { step: 40, time: 1 } }))).toEqual([
      'running', 'world size 2', '1 machine', 'restarts 0/1', '1m 15s', 'last commit: step 40'
    ]);
  });
});

describe('allocationsOf', () => {
  it('shows the launcher\'s allocations, pending first with the scheduler\'s reason', () => {
    const lines = [
      '12: running on em1', 'local2#3: leaving at the next commit', '14: pending (Resources)',
      'cannot start a machine: sbatch: error: invalid partition', '11: ended on em2'
    ];
    expect(allocationsOf(item({ machines: lines }))).toEqual([
      { text: '14: pending (Resources)', state: 'pending' },
      { text: '12: running on em1', state: 'running' },
      { text: 'local2#3: leaving at the next commit', state: 'leaving' },
      { text: '11: ended on em2', state: 'ended' },
      { text: 'cannot start a machine: sbatch: error: invalid partition', state: 'note' }
    ]);
  });

  it('is empty for a job without a launcher (and a kernel that sends no list)', () => {
    expect(allocationsOf(item())).toEqual([]);
    expect(allocationsOf(item({ machines: [] }))).toEqual([]);
  });
});

describe('actionsFor', () => {
  it('offers resize only where the bounds allow it, nothing once done', () => {
    expect(actionsFor(item({ can_resize: false }))).toEqual({ stop: true, stacks: true, resize: false });
    expect(actionsFor(item({ done: true, state: 'stopped' }))).toEqual({ stop: false, stacks: false, resize: false });
  });
});

describe('statusText', () => {
  it('shows the latest running job and how many more run', () => {
    const items = [item({ number: 1 }), item({ number: 3, world_size: 4 }), item({ number: 2, done: true })];
    expect(statusText(items)).toBe('elastic #3: running, world size 4, 1m 15s (+1)');
    expect(statusText([item({ done: true })])).toBe('');
  });
});

describe('notificationFor', () => {
  it('leads a failure with its root cause', () => {
    const n = notificationFor(item({ state: 'failed', done: true, root_cause: 'rank 1: ValueError: bad' }));
    expect(n).toEqual({ kind: 'error', message: 'elastic job #1 failed: rank 1: ValueError: bad' });
  });
  it('is quiet for a foreground job, whose cell shows the end', () => {
    expect(notificationFor(item({ background: false, state: 'succeeded', done: true }))).toBeNull();
    expect(notificationFor(item({ state: 'succeeded', done: true, elapsed: 5 }))?.message)
      .toBe('elastic job #1 succeeded in 5.0s');
  });
});

describe('resizeRequest', () => {
  it('refuses sizes outside the bounds, saying them', () => {
    expect(resizeRequest(item(), '5')).toBe('this job runs between 1 and 4 workers');
    expect(resizeRequest(item(), 'x')).toMatch(/whole number/);
    expect(resizeRequest(item(), '3')).toEqual({ action: 'scale', id: 'em-1', nproc: 3 });
  });
});

describe('isElasticCell', () => {
  it('recognises the cell magic on the first line only', () => {
    expect(isElasticCell('%%elastic --nproc 2\nimport torch')).toBe(true);
    expect(isElasticCell('%%elastic\n')).toBe(true);
    expect(isElasticCell('%%elasticity')).toBe(false);
    expect(isElasticCell('x = 1\n%%elastic')).toBe(false);
  });
});

describe('sessions', () => {
  const session = (over: Partial<IItem> = {}) =>
    item({ kind: 'session', number: 4, state: 'idle', background: false, cells: 3, ...over });
  it('are titled as sessions and list the cells they ran', () => {
    expect(titleOf(session())).toBe('#4 session');
    expect(titleOf(item())).toBe('#1 job');
    expect(describeItem(session({ restarts: 1, max_restarts: 3, last_commit: { step: 30, time: 1 } })))
      .toEqual(['idle', 'world size 2', '1 machine', 'restarts 1/3', '1m 15s', '3 cells run',
        'last commit: step 30']);
    expect(describeItem(session({ cells: 1 }))).toContain('1 cell run');
  });
  it('offer Stop, stacks and resize between cells, nothing once ended', () => {
    expect(actionsFor(session())).toEqual({ stop: true, stacks: true, resize: true });
    expect(actionsFor(session({ done: true, state: 'stopped' })))
      .toEqual({ stop: false, stacks: false, resize: false });
    expect(resizeRequest(session(), '9')).toBe('this session runs between 1 and 4 workers');
  });
  it('show in the status bar as a session, without a notification when they end', () => {
    expect(statusText([session(), item({ done: true })]))
      .toBe('elastic session #4: idle, world size 2, 1m 15s');
    expect(notificationFor(session({ done: true, state: 'stopped' }))).toBeNull();
  });
});

describe('recordsToAsk', () => {
  it('asks once for each finished job whose cell still shows its widget', () => {
    const view = { [WIDGET_VIEW]: { model_id: 'w1', version_major: 2 }, 'text/plain': 'x' };
    expect(showsWidget(view, 'w1')).toBe(true);
    expect(showsWidget(view, 'w2')).toBe(false);
    expect(showsWidget({ 'text/html': '<div class="elastic-record">' }, 'w1')).toBe(false);
    const done = item({ id: 'em-1', done: true, has_record: true, widget: 'w1' });
    const items = [
      done,
      item({ id: 'em-2', done: false, has_record: false, widget: 'w2' }), // still running
      item({ id: 'em-3', done: true, has_record: false, widget: 'w3' }), // view not finished
      item({ id: 'em-4', done: true, has_record: true, widget: null }) // --text: no widget
    ];
    const asked = new Set<string>();
    expect(recordsToAsk(items, () => true, asked)).toEqual([done]);
    expect(recordsToAsk(items, () => false, asked)).toEqual([]); // the swap came: none
    asked.add('em-1');
    expect(recordsToAsk(items, () => true, asked)).toEqual([]);
  });
});

describe('detached jobs', () => {
  const job = { id: 'em-20261129-1', title: '%%elastic --detach --nproc 2', elapsed: 125, pid: 4242 };
  it('are listed by their cell, how long they ran and their agent', () => {
    expect(describeDetached(job)).toBe(
      '%%elastic --detach --nproc 2 · running for 2m 05s · agent pid 4242');
  });
  it('are attached by the line magic a user would type', () => {
    expect(attachSource(job)).toBe('%elastic attach em-20261129-1');
  });
});
