//! Seats (spec §5): the exact number of requests in flight, across every VM, at an engine whose
//! group caps `max_inflight_requests`. The in-flight exchange runs a few milliseconds behind, so
//! two VMs deciding in one window could each fill an engine's last free slot; a seat is taken by
//! compare-and-swap before the request is dispatched and given back when its stage ends, so a
//! burst spread over any number of worker threads never exceeds the cap.
//!
//! Only capped groups pay: one read and one swap when a seat is taken and when it is given back;
//! no other request touches a seat. The value of an engine's key is a header and, for each VM
//! holding seats there, its id and count (12 bytes): at most one entry per live VM. A VM that dies
//! holding seats loses them to the service's sweep of dead VMs ([`SeatBook::reclaim`]); until
//! then its seats stay taken, so a crash can only under-admit.
//!
//! A give that cannot be written (the key stayed contended past the retries, or the host failed)
//! is owed and paid before this VM's next take.

use std::sync::{Arc, Mutex};

use crate::host::{Host, HostError};
use crate::state::{keys, shared};

const HEADER: [u8; 8] = *b"sglseat1";
const ENTRY: usize = 12;

/// What one VM holds at one engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Holding {
    vm: u64,
    seats: u32,
}

fn decode(bytes: &[u8]) -> Vec<Holding> {
    let Some(body) = bytes.strip_prefix(&HEADER[..]) else { return Vec::new() };
    body.chunks_exact(ENTRY)
        .filter_map(|c| {
            let vm = u64::from_le_bytes(c[..8].try_into().ok()?);
            let seats = u32::from_le_bytes(c[8..].try_into().ok()?);
            Some(Holding { vm, seats })
        })
        .collect()
}

fn encode(holdings: &[Holding]) -> Vec<u8> {
    let mut out = Vec::with_capacity(HEADER.len() + holdings.len() * ENTRY);
    out.extend_from_slice(&HEADER);
    for h in holdings.iter().filter(|h| h.seats > 0) {
        out.extend_from_slice(&h.vm.to_le_bytes());
        out.extend_from_slice(&h.seats.to_le_bytes());
    }
    out
}

fn taken(holdings: &[Holding]) -> u64 {
    holdings.iter().map(|h| u64::from(h.seats)).sum()
}

/// One VM's view of the seats of every capped engine.
#[derive(Debug)]
pub struct SeatBook {
    host: Arc<dyn Host>,
    vm: u64,
    /// Seats given back whose write failed: engine ids, paid before the next take.
    owed: Mutex<Vec<Arc<str>>>,
}

impl SeatBook {
    pub fn new(host: Arc<dyn Host>, vm: u64) -> Arc<Self> {
        Arc::new(Self { host, vm, owed: Mutex::default() })
    }

    /// Adds `delta` to this VM's seats at `engine` when `allow` says so of the seats taken by all.
    fn change(&self, engine: &str, delta: i64, allow: impl Fn(u64) -> bool) -> Result<bool, HostError> {
        shared::update(self.host.as_ref(), &keys::seats(engine), &HEADER, |bytes| {
            let mut holdings = decode(bytes);
            if !allow(taken(&holdings)) {
                return (bytes.to_vec(), false);
            }
            match holdings.iter_mut().find(|h| h.vm == self.vm) {
                Some(h) => h.seats = (i64::from(h.seats) + delta).clamp(0, i64::from(u32::MAX)) as u32,
                None if delta > 0 => holdings.push(Holding { vm: self.vm, seats: delta as u32 }),
                None => {}
            }
            (encode(&holdings), true)
        })
    }

    fn pay_owed(&self) {
        let owed = match self.owed.lock() {
            Ok(mut owed) => std::mem::take(&mut *owed),
            Err(_) => return,
        };
        for engine in owed {
            self.give(&engine);
        }
    }

    fn give(&self, engine: &Arc<str>) {
        if let Err(e) = self.change(engine, -1, |_| true) {
            log::warn!("seat at {engine} not given back yet: {e}");
            if let Ok(mut owed) = self.owed.lock() {
                owed.push(Arc::clone(engine));
            }
        }
    }

    /// A seat at `engine` if fewer than `cap` are taken; `None` when the engine is full or its
    /// seats cannot be read or written (a cap is never exceeded for want of a read).
    pub fn take(self: &Arc<Self>, engine: &Arc<str>, cap: u64) -> Option<Seat> {
        self.pay_owed();
        match self.change(engine, 1, |taken| taken < cap) {
            Ok(true) => Some(Seat { book: Arc::clone(self), engine: Arc::clone(engine) }),
            Ok(false) => None,
            Err(e) => {
                log::warn!("seats at {engine} unreadable, taken as full: {e}");
                None
            }
        }
    }

    /// A seat at `engine` whatever is taken: the request is there already (Envoy retried it there).
    pub fn force(self: &Arc<Self>, engine: &Arc<str>) -> Seat {
        if let Err(e) = self.change(engine, 1, |_| true) {
            log::warn!("seat at {engine} not counted: {e}");
        }
        Seat { book: Arc::clone(self), engine: Arc::clone(engine) }
    }

    /// Seats taken at `engine` by every VM.
    pub fn taken(&self, engine: &str) -> u64 {
        self.host.shared_get(&keys::seats(engine)).ok().flatten().map_or(0, |v| taken(&decode(&v.bytes)))
    }

    /// Drops the seats of the `dead` VMs at each of `engines` (the service, after its sweep).
    /// Returns how many it freed.
    pub fn reclaim<'a>(&self, engines: impl IntoIterator<Item = &'a str>, dead: &[u64]) -> Result<u64, HostError> {
        let mut freed = 0;
        for engine in engines {
            let key = keys::seats(engine);
            if self.host.shared_get(&key)?.is_none() {
                continue;
            }
            freed += shared::update(self.host.as_ref(), &key, &HEADER, |bytes| {
                let (dead_ones, live): (Vec<Holding>, Vec<Holding>) =
                    decode(bytes).into_iter().partition(|h| dead.contains(&h.vm));
                (encode(&live), taken(&dead_ones))
            })?;
        }
        Ok(freed)
    }
}

/// One seat at one engine, given back when dropped.
#[derive(Debug)]
pub struct Seat {
    book: Arc<SeatBook>,
    engine: Arc<str>,
}

impl Seat {
    pub fn engine(&self) -> &str {
        &self.engine
    }

    /// The request moved to `engine` (a retry): a seat there is counted, and this one is given
    /// back when its holder drops it.
    pub fn moved_to(&self, engine: &Arc<str>) -> Seat {
        self.book.force(engine)
    }
}

impl Drop for Seat {
    fn drop(&mut self) {
        self.book.give(&self.engine);
    }
}

/// The seats one decision took, one per capped engine it names, until each stage takes its own.
/// Clones share them; two are equal when they hold seats at the same engines.
#[derive(Debug, Clone, Default)]
pub struct Seats(Vec<Arc<Seat>>);

impl Seats {
    pub fn new(seats: Vec<Seat>) -> Self {
        Self(seats.into_iter().map(Arc::new).collect())
    }

    /// The seat held at `engine`, for the stage dispatched there.
    pub fn take(&mut self, engine: &str) -> Option<Arc<Seat>> {
        let i = self.0.iter().position(|s| s.engine() == engine)?;
        Some(self.0.swap_remove(i))
    }
}

impl PartialEq for Seats {
    fn eq(&self, other: &Self) -> bool {
        self.0.iter().map(|s| s.engine()).eq(other.0.iter().map(|s| s.engine()))
    }
}

impl Eq for Seats {}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::host::MemoryHost;
    use crate::testing::test;

    fn book(host: &Arc<MemoryHost>, vm: u64) -> Arc<SeatBook> {
        SeatBook::new(Arc::clone(host) as Arc<dyn Host>, vm)
    }

    #[test]
    fn two_vms_never_take_more_seats_than_the_cap() {
        let host = Arc::new(MemoryHost::new(7));
        let (a, b) = (book(&host, 1), book(&host, 2));
        let engine: Arc<str> = "A".into();
        let first = a.take(&engine, 2).unwrap();
        let second = b.take(&engine, 2).unwrap();
        assert!(a.take(&engine, 2).is_none() && b.take(&engine, 2).is_none(), "the cap counts both VMs");
        assert_eq!(a.taken("A"), 2);
        drop(first);
        assert_eq!(b.taken("A"), 1);
        let third = b.take(&engine, 2).unwrap();
        drop((second, third));
        assert_eq!(a.taken("A"), 0);
    }

    #[test]
    fn a_dead_vms_seats_are_reclaimed_and_a_moved_seat_counts_at_its_new_engine() {
        let host = Arc::new(MemoryHost::new(7));
        let (a, b) = (book(&host, 1), book(&host, 2));
        let (ea, eb): (Arc<str>, Arc<str>) = ("A".into(), "B".into());
        let lost = a.take(&ea, 1).unwrap();
        std::mem::forget(lost); // the VM died with it
        assert!(b.take(&ea, 1).is_none());
        assert_eq!(b.reclaim(["A", "B"], &[1]).unwrap(), 1);
        let seat = b.take(&ea, 1).unwrap();
        let moved = seat.moved_to(&eb);
        drop(seat);
        assert_eq!((b.taken("A"), b.taken("B")), (0, 1), "a retry takes its seat along, over the cap if need be");
        drop(moved);
        assert_eq!(b.taken("B"), 0);
    }

    #[test]
    fn a_give_that_cannot_be_written_is_paid_before_the_next_take() {
        let host = Arc::new(MemoryHost::new(7));
        let a = book(&host, 1);
        let engine: Arc<str> = "A".into();
        let seat = a.take(&engine, 1).unwrap();
        host.contend(Some("sgl.seats."));
        drop(seat);
        host.contend(None);
        assert_eq!(a.taken("A"), 1, "still taken: the write failed");
        assert!(a.take(&engine, 1).is_some(), "paid, then taken again");
    }
}
