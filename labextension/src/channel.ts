import { Kernel, KernelMessage as KM } from '@jupyterlab/services';

import { Action, IDetached, IItem, KernelMessage } from './model';

/** The comm target that elastic_magic registers in the kernel (elastic_magic/notebook/comm.py). */
export const TARGET = 'elastic_magic';
/** The display id of the kernel's announcement that the target is there. */
export const ANNOUNCE = 'application/vnd.elastic-magic.channel+json';

/** Whether an iopub message is the kernel's announcement (an update of no shown display). */
export function isAnnouncement(msg: KM.IIOPubMessage): boolean {
  const content = msg.content as { transient?: { display_id?: string } };
  return (
    msg.header.msg_type === 'update_display_data' && content.transient?.display_id === ANNOUNCE
  );
}

/**
 * One kernel's jobs, through the comm this side opens: when the kernel announces its target
 * (elastic_magic loaded, or a job started while no page had a comm), or when the page loads
 * after it did (the kernel lists its comms of our target).
 */
export class KernelChannel {
  items: IItem[] = [];
  detached: IDetached[] = []; // the user's detached jobs this kernel does not follow
  stacks = new Map<string, Record<string, string>>();
  errors = new Map<string, string>();
  records = new Map<string, Record<string, unknown>>(); // finished cells', until placed
  asked = new Set<string>(); // the records asked for (once each)
  private comms: Kernel.IComm[] = [];

  constructor(
    readonly kernel: Kernel.IKernelConnection,
    private changed: () => void,
    private finished: (item: IItem) => void
  ) {
    kernel.registerCommTarget(TARGET, (comm, msg) => {
      this.attach(comm);
      this.receive(msg.content.data as unknown as KernelMessage);
    });
    kernel.iopubMessage.connect((_, msg) => {
      if (isAnnouncement(msg) && !this.connected) {
        void this.open();
      }
    });
    kernel.statusChanged.connect((_, status) => {
      if (status === 'restarting' || status === 'autorestarting' || status === 'dead') {
        this.items = [];
        this.detached = [];
        this.comms = [];
        this.changed();
      }
    });
    void this.reopen();
  }

  /** A page that loads after elastic_magic did: open a comm of our own. */
  async reopen(): Promise<void> {
    try {
      const reply = await this.kernel.requestCommInfo({ target_name: TARGET });
      const content = reply.content as { comms?: Record<string, unknown> };
      if (Object.keys(content.comms ?? {}).length > 0 && !this.connected) {
        await this.open();
      }
    } catch {
      // a kernel without comm_info, or one that went away: nothing to show
    }
  }

  /** Whether a comm of ours is open (one the kernel's restart disposed of is not). */
  private get connected(): boolean {
    this.comms = this.comms.filter(c => !c.isDisposed);
    return this.comms.length > 0;
  }

  /**
   * Open a comm to the kernel's target, on the comm target's subshell where the kernel has
   * subshells: the main shell may be running a cell for hours (the job this panel would
   * show), and an open sent there would wait for it.
   */
  private async open(): Promise<void> {
    const comm = this.kernel.createComm(TARGET);
    this.attach(comm);
    try {
      await this.kernel.info;
      if (this.kernel.supportsSubshells) {
        await (comm as unknown as { subshellStarted: Promise<void> }).subshellStarted;
      }
    } catch {
      // no subshell for it: the main shell takes the open once it is free
    }
    if (!comm.isDisposed) {
      comm.open({});
    }
  }

  /** Whether an action sent now is carried out now: the kernel is idle, or takes comm
   * messages on a subshell beside a running cell (otherwise they would queue behind it). */
  get responsive(): boolean {
    return this.kernel.status === 'idle' || this.kernel.supportsSubshells;
  }

  send(action: Action): void {
    const comm = this.comms.filter(c => !c.isDisposed).pop();
    comm?.send(action as unknown as KM.ICommMsgMsg['content']['data']);
  }

  dispose(): void {
    this.kernel.removeCommTarget(TARGET, () => undefined);
    this.comms = [];
  }

  private attach(comm: Kernel.IComm): void {
    comm.onMsg = msg => this.receive(msg.content.data as unknown as KernelMessage);
    comm.onClose = () => {
      this.comms = this.comms.filter(c => c !== comm);
    };
    this.comms.push(comm);
  }

  private receive(message: KernelMessage): void {
    switch (message?.type) {
      case 'items':
        this.items = message.items;
        this.detached = message.detached ?? [];
        break;
      case 'finished':
        this.items = this.items.map(i => (i.id === message.item.id ? message.item : i));
        this.finished(message.item);
        break;
      case 'stacks':
        this.stacks.set(message.id, message.ranks);
        break;
      case 'record':
        this.records.set(message.id, message.bundle);
        break;
      case 'error':
        this.errors.set(message.id ?? '', message.text);
        break;
      default:
        return;
    }
    this.changed();
  }
}
