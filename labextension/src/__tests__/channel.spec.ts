import { KernelMessage as KM } from '@jupyterlab/services';

import { ANNOUNCE, isAnnouncement } from '../channel';

function message(type: string, displayId?: string): KM.IIOPubMessage {
  const transient = displayId === undefined ? {} : { transient: { display_id: displayId } };
  return { header: { msg_type: type }, content: { data: {}, metadata: {}, ...transient } } as
    unknown as KM.IIOPubMessage;
}

test('the kernel announces its comm target as an update of the display it names', () => {
  expect(isAnnouncement(message('update_display_data', ANNOUNCE))).toBe(true);
  expect(isAnnouncement(message('display_data', ANNOUNCE))).toBe(false); // a shown output
  expect(isAnnouncement(message('update_display_data', 'another-display'))).toBe(false);
  expect(isAnnouncement(message('update_display_data'))).toBe(false);
});
