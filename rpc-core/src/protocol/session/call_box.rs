//! A server call's future in a box the thread reuses.
//!
//! Every call a peer opens becomes one future of a type the session does
//! not know (the service's, the method's), so it is boxed: for a small
//! unary call the box is the largest allocation of the call (about 2 KiB:
//! the call's state, its deadline timer, the handler's future). Here the
//! box of a call that ended goes back to a pool of its thread, by the
//! future's type, and the next call of the same type on that thread is
//! written into it ([`Pin::set`]) instead of a new one. A connection that
//! serves one call at a time allocates none in steady state.
//!
//! A box goes back empty: the call's future is dropped first (as soon as
//! it finishes, or when it is dropped unfinished: a reset or the end of the
//! connection), so a pooled box holds nothing of any call. What the pool
//! keeps stays allocated for the thread's life, so it keeps a few boxes of
//! a few types, none larger than [`MAX_BYTES`].

use std::any::{Any, TypeId};
use std::cell::RefCell;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

/// Boxes kept per future type and thread: one call at a time on a
/// connection reuses one; a second covers a call whose box is dropped just
/// after the next call began.
const PER_TYPE: usize = 2;

/// Future types a thread keeps boxes of (the methods it serves, each on
/// the direct path or tonic's, with or without a span).
const TYPES: usize = 16;

/// Largest box kept: a larger future is freed when its call ends.
const MAX_BYTES: usize = 16 << 10;

/// Boxes of one future type `F`, empty ([`None`]).
type Boxes<F> = Vec<Pin<Box<Option<F>>>>;

thread_local! {
    /// Per future type: its [`Boxes`] (as `dyn Any`).
    static POOL: RefCell<Vec<(TypeId, Box<dyn Any>)>> = const { RefCell::new(Vec::new()) };
}

/// A call, not started yet: a future in a box that is reused once the
/// call ends (see the module docs).
pub(crate) struct CallFuture(Option<Pin<Box<dyn Slot>>>);

impl CallFuture {
    /// Boxes `f`, in a box an ended call of the same type left on this
    /// thread when there is one.
    pub(crate) fn new<F: Future<Output = ()> + Send + 'static>(f: F) -> CallFuture {
        let reused = POOL
            .try_with(|p| p.try_borrow_mut().ok().and_then(|mut p| take::<F>(&mut p)))
            .ok()
            .flatten();
        let slot: Pin<Box<dyn Slot>> = match reused {
            Some(mut b) => {
                b.set(Some(f));
                b
            }
            None => Box::pin(Some(f)),
        };
        CallFuture(Some(slot))
    }
}

impl Future for CallFuture {
    type Output = ();

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        match self.0.as_mut() {
            Some(slot) => slot.as_mut().poll_slot(cx),
            None => Poll::Ready(()),
        }
    }
}

impl Drop for CallFuture {
    fn drop(&mut self) {
        if let Some(slot) = self.0.take() {
            slot.recycle();
        }
    }
}

/// A box holding a call's future (`Some`) or nothing (`None`, once the
/// future finished or was dropped).
trait Slot: Send {
    /// Polls the future; the one that finishes is dropped at once.
    fn poll_slot(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()>;

    /// Drops the future, if any is left, and gives the box to the thread's
    /// pool.
    fn recycle(self: Pin<Box<Self>>);
}

impl<F: Future<Output = ()> + Send + 'static> Slot for Option<F> {
    fn poll_slot(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let Some(f) = self.as_mut().as_pin_mut() else {
            return Poll::Ready(());
        };
        let r = f.poll(cx);
        if r.is_ready() {
            self.set(None);
        }
        r
    }

    fn recycle(mut self: Pin<Box<Self>>) {
        // The future's own drop runs here, outside the pool's borrow (it
        // may end other calls).
        self.set(None);
        if std::mem::size_of::<Self>() > MAX_BYTES {
            return;
        }
        let _ = POOL.try_with(move |p| {
            if let Ok(mut p) = p.try_borrow_mut() {
                put::<F>(&mut p, self);
            }
        });
    }
}

/// An empty box for a future of type `F` from `pool`.
fn take<F: 'static>(pool: &mut [(TypeId, Box<dyn Any>)]) -> Option<Pin<Box<Option<F>>>> {
    let id = TypeId::of::<F>();
    pool.iter_mut()
        .find(|(t, _)| *t == id)
        .and_then(|(_, boxes)| boxes.downcast_mut::<Boxes<F>>())
        .and_then(|boxes| boxes.pop())
}

/// Keeps the empty box `b` in `pool` if there is room for it.
fn put<F: 'static>(pool: &mut Vec<(TypeId, Box<dyn Any>)>, b: Pin<Box<Option<F>>>) {
    let id = TypeId::of::<F>();
    let boxes = match pool.iter().position(|(t, _)| *t == id) {
        Some(i) => &mut pool[i].1,
        None if pool.len() < TYPES => {
            pool.push((id, Box::new(Boxes::<F>::with_capacity(PER_TYPE))));
            &mut pool.last_mut().expect("just pushed").1
        }
        None => return,
    };
    if let Some(boxes) = boxes.downcast_mut::<Boxes<F>>() {
        if boxes.len() < PER_TYPE {
            boxes.push(b);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;
    use std::task::Waker;

    /// Counts its drops.
    struct Dropped(Arc<AtomicUsize>);

    impl Drop for Dropped {
        fn drop(&mut self) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    fn poll(c: &mut CallFuture) -> Poll<()> {
        Pin::new(c).poll(&mut Context::from_waker(Waker::noop()))
    }

    fn address(c: &CallFuture) -> usize {
        let b = c.0.as_ref().expect("not dropped");
        (&**b as *const dyn Slot).cast::<()>() as usize
    }

    /// A call future that holds `d` until it finishes after one pending poll.
    async fn call(d: Dropped) {
        let mut first = true;
        std::future::poll_fn(|_| {
            if std::mem::take(&mut first) {
                Poll::Pending
            } else {
                Poll::Ready(())
            }
        })
        .await;
        drop(d);
    }

    #[test]
    fn an_ended_calls_box_is_reused_by_the_next_call_of_its_type() {
        let drops = Arc::new(AtomicUsize::new(0));
        let mut a = CallFuture::new(call(Dropped(drops.clone())));
        let at = address(&a);
        assert!(poll(&mut a).is_pending());
        assert!(poll(&mut a).is_ready());
        assert_eq!(drops.load(Ordering::SeqCst), 1, "dropped when it finished");
        drop(a);
        let mut b = CallFuture::new(call(Dropped(drops.clone())));
        assert_eq!(address(&b), at, "the same box");
        assert!(poll(&mut b).is_pending());
        assert!(poll(&mut b).is_ready());
        assert!(
            poll(&mut b).is_ready(),
            "polled again after it ended: still ready"
        );
        assert_eq!(drops.load(Ordering::SeqCst), 2);
    }

    #[test]
    fn an_unfinished_call_is_dropped_before_its_box_is_kept() {
        let drops = Arc::new(AtomicUsize::new(0));
        let mut a = CallFuture::new(call(Dropped(drops.clone())));
        let at = address(&a);
        assert!(poll(&mut a).is_pending());
        drop(a);
        assert_eq!(
            drops.load(Ordering::SeqCst),
            1,
            "the future's state dropped"
        );
        // The next call of the type starts afresh in that box.
        let mut b = CallFuture::new(call(Dropped(drops.clone())));
        assert_eq!(address(&b), at);
        assert!(
            poll(&mut b).is_pending(),
            "a new future, not the old one's state"
        );
        drop(b);
        assert_eq!(drops.load(Ordering::SeqCst), 2);
    }

    #[test]
    fn another_type_gets_a_box_of_its_own() {
        let a = CallFuture::new(async {});
        let at = address(&a);
        drop(a);
        let b = CallFuture::new(async { std::future::ready(()).await });
        assert_ne!(address(&b), at);
    }

    /// The empty boxes this thread keeps for futures of `F`'s type.
    fn kept<F: 'static>(_: &F) -> usize {
        POOL.with(|p| {
            p.borrow()
                .iter()
                .filter_map(|(_, b)| b.downcast_ref::<Boxes<F>>())
                .map(Vec::len)
                .sum()
        })
    }

    #[test]
    fn a_thread_keeps_few_boxes() {
        let make = || async {};
        let calls: Vec<_> = (0..PER_TYPE + 3).map(|_| CallFuture::new(make())).collect();
        assert_eq!(kept(&make()), 0, "all in use");
        drop(calls);
        assert_eq!(kept(&make()), PER_TYPE, "the others were freed");
        let again = CallFuture::new(make());
        assert_eq!(kept(&make()), PER_TYPE - 1, "one taken");
        drop(again);
        assert_eq!(kept(&make()), PER_TYPE);
    }
}
