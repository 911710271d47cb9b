//! Crash images: what the disk may hold if the power fails at a given line of the trace.
//!
//! The model, per change of the store file (a write or a resize):
//! - it is **durable** once it returned through an `O_DSYNC` descriptor (a write only), or
//!   once an `fdatasync`/`fsync` of the file that *started after it returned* has returned;
//! - a change that started before the crash but is not durable is **pending**: the disk may
//!   hold it whole, not at all, or torn (a prefix ending at a 512-byte or 4 KiB boundary of the
//!   file, or any subset of its 512-byte sectors: a sector is the unit a disk writes
//!   atomically);
//! - a change that had not started is absent.
//!
//! The image applies, in the order the calls started, every durable change and the chosen
//! fate of each pending one, so a later write over an earlier one wins where both landed and
//! a dropped later write leaves the earlier bytes. (A real disk writes whole pages: a pending
//! write sharing a page with a durable one may in truth be durable too. Treating it as pending
//! reaches more states than the disk can, never fewer.)

use super::trace::{Barrier, Change, FileOp};

pub const SECTOR: u64 = 512;
pub const PAGE: u64 = 4096;

/// What became of one pending change.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fate {
    Kept,
    Dropped,
    /// The first `n` bytes landed.
    Prefix(u64),
    /// The 512-byte sectors of the file whose bit is set landed (bit i: the i-th sector the
    /// write touches; a write over more than 64 sectors keeps the rest whole).
    Sectors(u64),
}

/// The changes of one trace, ordered by start, with the line from which each is durable.
pub struct History {
    ops: Vec<FileOp>,
    durable_from: Vec<usize>,
    /// Every change before this index is durable at every crash point asked from now on;
    /// `base` is the file they leave.
    base_upto: usize,
    base: Vec<u8>,
    last_point: usize,
}

impl History {
    pub fn new(mut ops: Vec<FileOp>, barriers: &[Barrier]) -> History {
        ops.sort_by_key(|op| op.start);
        let durable_from = ops.iter().map(|op| durable_from(op, barriers)).collect();
        History {
            ops,
            durable_from,
            base_upto: 0,
            base: Vec::new(),
            last_point: 0,
        }
    }

    /// The changes pending if the power fails just before trace line `point` (lines before
    /// it happened): started, not yet durable. Indexes into the history.
    pub fn pending(&self, point: usize) -> Vec<usize> {
        (0..self.ops.len())
            .filter(|&i| self.ops[i].start < point && self.durable_from[i] > point)
            .collect()
    }

    pub fn op(&self, index: usize) -> &FileOp {
        &self.ops[index]
    }

    /// The image at `point` with `fate(index)` for each pending change. Points must be asked
    /// in increasing order (the durable prefix is kept between calls).
    pub fn image(&mut self, point: usize, mut fate: impl FnMut(usize) -> Fate) -> Vec<u8> {
        assert!(point >= self.last_point, "crash points out of order");
        self.last_point = point;
        while self.base_upto < self.ops.len() && self.durable_from[self.base_upto] <= point {
            apply(&mut self.base, &self.ops[self.base_upto].change, Fate::Kept);
            self.base_upto += 1;
        }
        let mut image = self.base.clone();
        for i in self.base_upto..self.ops.len() {
            let op = &self.ops[i];
            if op.start >= point {
                break;
            }
            let chosen = if self.durable_from[i] <= point {
                Fate::Kept
            } else {
                fate(i)
            };
            apply(&mut image, &op.change, chosen);
        }
        image
    }

    /// Lines at which something happened to the file (a change or barrier started or
    /// returned): the crash points worth trying lie just after them.
    pub fn points(&self, barriers: &[Barrier]) -> Vec<usize> {
        let mut points: Vec<usize> = self
            .ops
            .iter()
            .flat_map(|op| [op.start + 1, op.end + 1])
            .chain(barriers.iter().flat_map(|b| [b.start + 1, b.end + 1]))
            .collect();
        points.sort_unstable();
        points.dedup();
        points
    }
}

/// The first crash point (a line count) at which `op` is durable; `usize::MAX` if never.
fn durable_from(op: &FileOp, barriers: &[Barrier]) -> usize {
    let by_itself = match op.change {
        Change::Data { .. } if op.dsync => op.end + 1,
        _ => usize::MAX,
    };
    let by_barrier = barriers
        .iter()
        .filter(|b| b.start > op.end)
        .map(|b| b.end + 1)
        .min()
        .unwrap_or(usize::MAX);
    by_itself.min(by_barrier)
}

fn apply(image: &mut Vec<u8>, change: &Change, fate: Fate) {
    match (change, fate) {
        (_, Fate::Dropped) => {}
        (Change::Resize { len }, _) => image.resize(*len as usize, 0),
        (Change::Data { offset, data }, Fate::Kept) => put(image, *offset, data),
        (Change::Data { offset, data }, Fate::Prefix(n)) => {
            put(image, *offset, &data[..(n as usize).min(data.len())]);
        }
        (Change::Data { offset, data }, Fate::Sectors(mask)) => {
            for (i, (start, end)) in sectors(*offset, data.len() as u64).enumerate() {
                if i >= 64 || mask & (1 << i) != 0 {
                    let slice = &data[(start - offset) as usize..(end - offset) as usize];
                    put(image, start, slice);
                }
            }
        }
    }
}

fn put(image: &mut Vec<u8>, offset: u64, data: &[u8]) {
    let (start, end) = (offset as usize, offset as usize + data.len());
    if image.len() < end {
        image.resize(end, 0);
    }
    image[start..end].copy_from_slice(data);
}

/// The file's 512-byte sectors that `[offset, offset + len)` touches, clipped to the write.
pub fn sectors(offset: u64, len: u64) -> impl Iterator<Item = (u64, u64)> {
    let end = offset + len;
    let first = offset / SECTOR;
    let last = end.div_ceil(SECTOR);
    (first..last).map(move |s| ((s * SECTOR).max(offset), ((s + 1) * SECTOR).min(end)))
}

/// The torn lengths of a write: every prefix that ends at a `unit` boundary of the file,
/// strictly inside the write.
pub fn tears(offset: u64, len: u64, unit: u64) -> Vec<u64> {
    let end = offset + len;
    let mut cut = (offset / unit + 1) * unit;
    let mut out = Vec::new();
    while cut < end {
        out.push(cut - offset);
        cut += unit;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn data(start: usize, end: usize, offset: u64, byte: u8, dsync: bool) -> FileOp {
        FileOp {
            start,
            end,
            change: Change::Data {
                offset,
                data: vec![byte; 1024],
            },
            dsync,
        }
    }

    #[test]
    fn durability_follows_barriers_and_o_dsync() {
        // 0: write A (plain), 1: write B (O_DSYNC), 2..3: fdatasync, 4: write C over A.
        let ops = vec![
            data(0, 0, 0, 0xaa, false),
            data(1, 1, 4096, 0xbb, true),
            data(4, 4, 0, 0xcc, false),
        ];
        let barriers = [Barrier { start: 2, end: 3 }];
        let mut history = History::new(ops, &barriers);
        assert_eq!(history.pending(2), vec![0]);
        let image = history.image(2, |_| Fate::Dropped);
        assert_eq!(image.len(), 4096 + 1024);
        assert_eq!(image[0], 0);
        assert_eq!(image[4096], 0xbb);
        assert_eq!(history.pending(5), vec![2]);
        let dropped = history.image(5, |_| Fate::Dropped);
        assert_eq!(dropped[0], 0xaa);
        let torn = history.image(5, |_| Fate::Prefix(512));
        assert_eq!((torn[0], torn[600]), (0xcc, 0xaa));
        let sectors = history.image(5, |_| Fate::Sectors(0b10));
        assert_eq!((sectors[0], sectors[600]), (0xaa, 0xcc));
    }

    #[test]
    fn tears_fall_on_file_boundaries() {
        assert_eq!(tears(100, 1000, 512), vec![412, 924]);
        assert_eq!(tears(0, 4096, 4096), Vec::<u64>::new());
        assert_eq!(sectors(100, 1000).count(), 3);
    }
}
