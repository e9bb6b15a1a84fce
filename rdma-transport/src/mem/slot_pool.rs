//! A ring of equal slots (a connection's receive or send ring) registered
//! a segment at a time, as the ring grows, and given back a segment at a
//! time as it shrinks (wire protocol §4.6).

use super::device_pool::BlockSource;
use super::registered::{Access, RegisteredBuf};
use crate::error::Error;

/// A ring of equal slots registered a segment at a time, on demand.
pub(super) struct SlotPool {
    segs: Vec<Option<RegisteredBuf>>,
    seg_slots: usize,
    slot_bytes: usize,
    slots: usize,
}

impl SlotPool {
    pub(super) fn new(slots: usize, slot_bytes: usize, seg_slots: usize) -> SlotPool {
        let seg_slots = seg_slots.clamp(1, slots.max(1));
        SlotPool {
            segs: (0..slots.div_ceil(seg_slots)).map(|_| None).collect(),
            seg_slots,
            slot_bytes,
            slots,
        }
    }

    /// Registers (or takes from the pool) every segment that holds one of
    /// slots `0..n`.
    pub(super) fn ensure(&mut self, reg: &BlockSource, n: usize) -> Result<(), Error> {
        let n = n.min(self.slots);
        for k in 0..n.div_ceil(self.seg_slots) {
            if self.segs[k].is_none() {
                let count = self.seg_slots.min(self.slots - k * self.seg_slots);
                self.segs[k] = Some(reg.take(count * self.slot_bytes, Access::Local)?);
            }
        }
        Ok(())
    }

    /// Gives back every segment whose slots are all at or above `n` (the
    /// caller guarantees none of them is posted).
    pub(super) fn trim(&mut self, reg: &BlockSource, n: usize) {
        for k in n.div_ceil(self.seg_slots)..self.segs.len() {
            if let Some(b) = self.segs[k].take() {
                reg.put(b);
            }
        }
    }

    /// The registered segment holding slot `i`, and the slot's offset in it.
    #[inline]
    pub(super) fn at(&self, i: usize) -> (&RegisteredBuf, usize) {
        assert!(i < self.slots, "slot {i} out of range");
        let seg = self.segs[i / self.seg_slots]
            .as_ref()
            .expect("the engine uses registered slots only");
        (seg, (i % self.seg_slots) * self.slot_bytes)
    }

    #[inline]
    pub(super) fn at_mut(&mut self, i: usize) -> (&mut RegisteredBuf, usize) {
        assert!(i < self.slots, "slot {i} out of range");
        let seg = self.segs[i / self.seg_slots]
            .as_mut()
            .expect("the engine uses registered slots only");
        (seg, (i % self.seg_slots) * self.slot_bytes)
    }
}
