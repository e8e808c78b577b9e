//! A memory budget for untrusted work on one thread (chat templates, which are programs from a model
//! file or the command line).
//!
//! The process's allocator ([`Counting`], over the system's) counts the bytes that a thread inside
//! [`Budget::enter`] allocates and frees. An allocation that would take the thread past its budget
//! never returns: the thread marks the budget exceeded and sleeps for good, keeping what it held
//! (at most the budget), and the thread waiting for its result sees [`Budget::exceeded`] and
//! reports it in one line.
//!
//! Why a sleeping thread and not an error: Rust cannot unwind out of an allocator, and a null
//! return ends the process (`handle_alloc_error` aborts), so a thread that stops inside the
//! allocator is the one way to refuse an allocation and keep the process. Bounding the template
//! engine from outside instead would mean re-implementing each operation that grows a value
//! (minijinja's lazy `seq * n` materialised by `list`, `batch`, `~`, `replace`, `join`, …) and
//! every one it adds later; counting bytes at the allocator bounds them all, including the ones
//! nobody thought of. The cost outside a budget is one thread-local read per allocation.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

/// A limit on the bytes one thread may hold at once, shared with whoever waits for that thread.
#[derive(Debug)]
pub struct Budget {
    limit: usize,
    exceeded: AtomicBool,
}

thread_local! {
    /// The budget of this thread (null: none), and the bytes it holds under it.
    static CURRENT: Cell<*const Budget> = const { Cell::new(std::ptr::null()) };
    static HELD: Cell<isize> = const { Cell::new(0) };
}

impl Budget {
    pub fn new(limit: usize) -> Arc<Self> {
        Arc::new(Self {
            limit,
            exceeded: AtomicBool::new(false),
        })
    }

    pub fn limit(&self) -> usize {
        self.limit
    }

    /// Whether a thread under this budget asked for more than it allows (and now sleeps).
    pub fn exceeded(&self) -> bool {
        self.exceeded.load(Ordering::SeqCst)
    }

    /// Puts the calling thread under `budget` until the guard drops; what it frees of memory it
    /// had before counts in its favour.
    pub fn enter(budget: &Arc<Self>) -> Entered {
        let keep = Arc::clone(budget);
        HELD.with(|h| h.set(0));
        CURRENT.with(|c| c.set(Arc::as_ptr(&keep)));
        Entered { _budget: keep }
    }
}

/// The calling thread is under a budget while this lives (it holds the budget alive, so the
/// allocator's pointer to it stays valid).
pub struct Entered {
    _budget: Arc<Budget>,
}

impl Drop for Entered {
    fn drop(&mut self) {
        CURRENT.with(|c| c.set(std::ptr::null()));
    }
}

/// Counts `delta` bytes against the calling thread's budget; past it, never returns.
fn charge(delta: isize) {
    let budget = CURRENT.with(Cell::get);
    if budget.is_null() {
        return;
    }
    let held = HELD.with(|h| {
        let n = h.get().saturating_add(delta);
        h.set(n);
        n
    });
    // SAFETY of the dereference: `CURRENT` is set only by `Budget::enter`, to a budget that its
    // `Entered` guard keeps alive, and cleared when that guard drops on this thread.
    let b = unsafe { &*budget };
    if delta > 0 && held > b.limit as isize {
        // Stop counting (the sleep below must not recurse into this), tell the waiting thread,
        // and stay here: this allocation neither fails (an abort) nor succeeds.
        CURRENT.with(|c| c.set(std::ptr::null()));
        b.exceeded.store(true, Ordering::SeqCst);
        loop {
            std::thread::sleep(std::time::Duration::from_secs(3600));
        }
    }
}

/// The system allocator, counting the bytes of threads under a [`Budget`].
pub struct Counting;

// SAFETY: every method forwards to `System` with the caller's arguments unchanged; `charge` only
// reads and writes this thread's const-initialised thread-locals (no allocation, no destructor, so
// usable at any point of a thread's life) and either returns or never returns.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        charge(layout.size() as isize);
        System.alloc(layout)
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        charge(layout.size() as isize);
        System.alloc_zeroed(layout)
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        charge(-(layout.size() as isize));
        System.dealloc(ptr, layout)
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        charge(new_size as isize - layout.size() as isize);
        System.realloc(ptr, layout, new_size)
    }
}

/// Gives the heap's free memory back to the system: after a burst of large allocations that are
/// gone (a server's flood of request bodies), which the allocator otherwise keeps for reuse (main.rs
/// tells glibc to keep up to 256 MiB free at the top of the heap, for the forward pass's sake).
/// Takes a few milliseconds; call it off latency-critical threads.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
pub fn release_free_memory() {
    // SAFETY: malloc_trim only reads and changes the allocator's own state, under its own locks
    // (glibc: "MT-Safe"); it frees nothing that is in use.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// Elsewhere the allocator is the system's own, which returns what it wants to.
#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
pub fn release_free_memory() {}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, Instant};

    /// Runs `f` on a thread under a budget of `limit` bytes: Some(its result), or None once the
    /// budget says it was exceeded.
    fn run_under<T: Send + 'static>(limit: usize, f: fn() -> T) -> Option<T> {
        let budget = Budget::new(limit);
        let b = budget.clone();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let _in = Budget::enter(&b);
            let r = f();
            let _ = tx.send(r);
        });
        let t0 = Instant::now();
        while t0.elapsed() < Duration::from_secs(20) {
            if let Ok(r) = rx.recv_timeout(Duration::from_millis(5)) {
                return Some(r);
            }
            if budget.exceeded() {
                return None;
            }
        }
        panic!("neither a result nor an exceeded budget in 20 s");
    }

    #[test]
    fn work_within_the_budget_returns_its_result() {
        let n = run_under(1 << 20, || {
            vec![7u8; 100_000].iter().map(|&x| x as usize).sum()
        });
        assert_eq!(n, Some(700_000));
    }

    #[test]
    fn a_single_allocation_past_the_budget_stops_the_thread_not_the_process() {
        // 24 TB: the system allocator would fail it, and a failed allocation aborts.
        let r = run_under(1 << 20, || {
            Vec::<u64>::with_capacity(3_000_000_000_000).capacity()
        });
        assert_eq!(r, None);
    }

    #[test]
    fn doubling_a_string_stops_at_the_budget() {
        let r = run_under(4 << 20, || {
            let mut s = String::from("x");
            for _ in 0..40 {
                s = s.repeat(2);
            }
            s.len()
        });
        assert_eq!(r, None);
    }

    #[test]
    fn memory_freed_under_the_budget_can_be_allocated_again() {
        // 100 rounds of 1 MiB under a 2 MiB budget: what is freed counts back.
        let r = run_under(2 << 20, || {
            (0..100)
                .map(|i| vec![i as u8; 1 << 20][1234] as usize)
                .sum::<usize>()
        });
        assert_eq!(r, Some((0..100).sum()));
    }

    #[test]
    fn a_thread_is_counted_only_while_it_is_entered() {
        let budget = Budget::new(1024);
        let entered = Budget::enter(&budget);
        drop(entered);
        let v = vec![0u8; 10 << 20];
        assert_eq!(v.len(), 10 << 20);
        assert!(!budget.exceeded());
    }
}
