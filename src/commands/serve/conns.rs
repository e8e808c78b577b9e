//! Connections: which are let in, and which are closed to make room (issue 64).
//!
//! Every open connection is one row of one table: its peer, how many of its requests are in
//! flight, and since when it has been idle. A connection is *idle* when no request of its is in
//! flight: it waits for its first request's headers (a slow-loris client trickling them is idle),
//! or is kept alive between requests. A request is in flight from the moment its headers are read
//! until its answer's last byte is sent (a streamed answer included).
//!
//! - A new connection is let in while there is room. Past the server's `total`, or its peer's
//!   `per_peer`, the connection idle longest (of that peer, when the peer is at its cap) is closed
//!   to make room; only when every one is busy does the newcomer get a 503 with `Retry-After`.
//! - An idle connection is closed after a deadline that shrinks as the server fills: `idle` while
//!   half the places or fewer are taken, then down in proportion to `min_idle` when all are.
//!
//! So a client holding hundreds of sockets open without sending anything keeps no one out: each
//! newcomer closes the oldest of them, and under a flood they are closed in well under a second.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::Notify;

/// The table's bounds.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Connections open at once.
    pub total: usize,
    /// Connections one peer address may hold at once.
    pub per_peer: usize,
    /// How long an idle connection is kept while half the places or fewer are taken.
    pub idle: Duration,
    /// How long when every place is taken.
    pub min_idle: Duration,
}

/// The open connections.
pub struct Conns {
    limits: Limits,
    table: Mutex<Table>,
}

#[derive(Default)]
struct Table {
    next: u64,
    open: HashMap<u64, Row>,
    per_peer: HashMap<IpAddr, usize>,
}

struct Row {
    peer: IpAddr,
    in_flight: usize,
    idle_since: Instant,
    close: Arc<Notify>,
}

/// Whether a new connection was let in.
pub enum Admission {
    In(Conn),
    /// Every place (`"server"`) or every place of its peer (`"peer"`) holds a request in flight.
    Full(&'static str),
}

/// A place in the table, given back when dropped.
pub struct Conn {
    id: u64,
    conns: Arc<Conns>,
    close: Arc<Notify>,
}

/// A request in flight on a connection; the connection is idle again when the last one drops.
pub struct InFlight {
    id: u64,
    conns: Arc<Conns>,
}

impl Conns {
    pub fn new(limits: Limits) -> Arc<Self> {
        Arc::new(Self {
            limits,
            table: Mutex::new(Table::default()),
        })
    }

    fn table(&self) -> std::sync::MutexGuard<'_, Table> {
        self.table.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// How long an idle connection is kept when `open` places are taken.
    pub fn idle_deadline(&self, open: usize) -> Duration {
        let Limits {
            total,
            idle,
            min_idle,
            ..
        } = self.limits;
        let half = total / 2;
        if open <= half {
            return idle;
        }
        // From `idle` at half full down to `min_idle` when full, in a straight line.
        let past = (open - half) as f64 / (total - half).max(1) as f64;
        idle.mul_f64(1.0 - past.min(1.0)).max(min_idle).min(idle)
    }

    /// Lets a connection from `peer` in, closing idle ones to make room where needed.
    pub fn admit(self: &Arc<Self>, peer: IpAddr) -> Admission {
        let now = Instant::now();
        let mut t = self.table();
        // Idle connections past the deadline that this fill sets go first.
        if t.open.len() > self.limits.total / 2 {
            let deadline = self.idle_deadline(t.open.len() + 1);
            let expired: Vec<u64> = t
                .open
                .iter()
                .filter(|(_, r)| r.in_flight == 0 && now - r.idle_since >= deadline)
                .map(|(&id, _)| id)
                .collect();
            for id in expired {
                t.close(id);
            }
        }
        if t.per_peer.get(&peer).copied().unwrap_or(0) >= self.limits.per_peer
            && !t.close_oldest_idle(Some(peer))
        {
            return Admission::Full("peer");
        }
        if t.open.len() >= self.limits.total && !t.close_oldest_idle(None) {
            return Admission::Full("server");
        }
        t.next += 1;
        let id = t.next;
        let close = Arc::new(Notify::new());
        t.open.insert(
            id,
            Row {
                peer,
                in_flight: 0,
                idle_since: now,
                close: close.clone(),
            },
        );
        *t.per_peer.entry(peer).or_default() += 1;
        Admission::In(Conn {
            id,
            conns: self.clone(),
            close,
        })
    }

    /// Connections open now.
    pub fn open(&self) -> usize {
        self.table().open.len()
    }

    /// Connections with a request in flight now.
    pub fn busy(&self) -> usize {
        self.table()
            .open
            .values()
            .filter(|r| r.in_flight > 0)
            .count()
    }
}

impl Table {
    /// Takes connection `id` out of the table and tells its task to close it.
    fn close(&mut self, id: u64) {
        if let Some(row) = self.remove(id) {
            row.close.notify_one();
        }
    }

    fn remove(&mut self, id: u64) -> Option<Row> {
        let row = self.open.remove(&id)?;
        if let Some(n) = self.per_peer.get_mut(&row.peer) {
            *n -= 1;
            if *n == 0 {
                self.per_peer.remove(&row.peer);
            }
        }
        Some(row)
    }

    /// Closes the connection idle longest (of `peer`, where given); false if none is idle.
    fn close_oldest_idle(&mut self, peer: Option<IpAddr>) -> bool {
        let oldest = self
            .open
            .iter()
            .filter(|(_, r)| r.in_flight == 0 && peer.is_none_or(|p| r.peer == p))
            .min_by_key(|(_, r)| r.idle_since)
            .map(|(&id, _)| id);
        match oldest {
            Some(id) => {
                self.close(id);
                true
            }
            None => false,
        }
    }
}

impl Conn {
    /// Marks a request in flight until the returned guard drops.
    pub fn request(&self) -> InFlight {
        if let Some(row) = self.conns.table().open.get_mut(&self.id) {
            row.in_flight += 1;
        }
        InFlight {
            id: self.id,
            conns: self.conns.clone(),
        }
    }

    /// Resolves when this connection must close: another took its place, or it stayed idle past
    /// its deadline.
    pub async fn must_close(&self) {
        loop {
            let wait = {
                let mut t = self.conns.table();
                let open = t.open.len();
                let Some(row) = t.open.get(&self.id) else {
                    return;
                };
                if row.in_flight > 0 {
                    // Checked again when the request ends, at the latest a deadline from now.
                    self.conns.limits.idle
                } else {
                    let deadline = row.idle_since + self.conns.idle_deadline(open);
                    let now = Instant::now();
                    if now >= deadline {
                        t.remove(self.id);
                        return;
                    }
                    deadline - now
                }
            };
            // Told to close (the row is gone) or woken to time an idle spell: look again.
            tokio::select! {
                _ = self.close.notified() => {}
                _ = tokio::time::sleep(wait) => {}
            }
        }
    }
}

impl Drop for Conn {
    fn drop(&mut self) {
        self.conns.table().remove(self.id);
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        let mut t = self.conns.table();
        if let Some(row) = t.open.get_mut(&self.id) {
            row.in_flight -= 1;
            if row.in_flight == 0 {
                row.idle_since = Instant::now();
                // Its task sleeps a whole deadline while a request is in flight: wake it to time
                // the idle one from now.
                row.close.notify_one();
            }
        }
    }
}

/// An answer's body that holds its request in flight until the body is sent or dropped.
pub struct Tracked {
    pub body: axum::body::Body,
    pub in_flight: InFlight,
}

impl http_body::Body for Tracked {
    type Data = axum::body::Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<Self::Data>, Self::Error>>> {
        std::pin::Pin::new(&mut self.body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.body.size_hint()
    }
}

/// The answer a connection gets when there is no place for it: a 503 with `Retry-After`, written
/// straight to the socket (no request was read), then the socket closed.
pub fn full_answer(why: &str) -> Vec<u8> {
    let who = match why {
        "peer" => "your address already holds as many connections as one client may",
        _ => "every connection the server keeps is busy",
    };
    let body = serde_json::json!({"error": {
        "message": format!("the server is full: {who}; retry in a second"),
        "type": "server_error",
        "param": null,
        "code": "server_full",
    }})
    .to_string();
    format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\ncontent-length: {}\r\nretry-after: 1\r\nconnection: close\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

#[cfg(test)]
mod tests {
    use super::*;

    const A: IpAddr = IpAddr::V4(std::net::Ipv4Addr::new(10, 0, 0, 1));
    const B: IpAddr = IpAddr::V4(std::net::Ipv4Addr::new(10, 0, 0, 2));

    fn conns(total: usize, per_peer: usize) -> Arc<Conns> {
        Conns::new(Limits {
            total,
            per_peer,
            idle: Duration::from_secs(10),
            min_idle: Duration::from_millis(500),
        })
    }

    fn admitted(a: Admission) -> Conn {
        match a {
            Admission::In(c) => c,
            Admission::Full(why) => panic!("refused: {why}"),
        }
    }

    #[test]
    fn the_idle_deadline_is_whole_to_half_full_and_shrinks_to_its_floor_when_full() {
        let c = conns(512, 512);
        assert_eq!(c.idle_deadline(0), Duration::from_secs(10));
        assert_eq!(c.idle_deadline(256), Duration::from_secs(10));
        assert_eq!(c.idle_deadline(384), Duration::from_secs(5));
        assert_eq!(c.idle_deadline(512), Duration::from_millis(500));
        assert_eq!(c.idle_deadline(600), Duration::from_millis(500));
    }

    #[test]
    fn a_full_server_closes_its_oldest_idle_connection_to_let_a_new_one_in() {
        let c = conns(3, 3);
        let first = admitted(c.admit(A));
        std::thread::sleep(Duration::from_millis(2));
        let second = admitted(c.admit(A));
        let _third = admitted(c.admit(A));
        let _fourth = admitted(c.admit(B));
        assert_eq!(c.open(), 3);
        assert!(!c.table().open.contains_key(&first.id), "the oldest stays");
        assert!(c.table().open.contains_key(&second.id));
    }

    #[test]
    fn connections_with_requests_in_flight_are_never_closed_and_a_newcomer_gets_full() {
        let c = conns(2, 2);
        let a = admitted(c.admit(A));
        let b = admitted(c.admit(B));
        let (_ra, _rb) = (a.request(), b.request());
        assert!(matches!(c.admit(A), Admission::Full("server")));
        assert_eq!(c.open(), 2);
    }

    #[test]
    fn a_peer_at_its_cap_closes_its_own_idle_connection_not_anothers() {
        let c = conns(10, 2);
        let other = admitted(c.admit(B));
        let a1 = admitted(c.admit(A));
        let a2 = admitted(c.admit(A));
        let _a3 = admitted(c.admit(A));
        let t = c.table();
        assert!(t.open.contains_key(&other.id));
        assert!(!t.open.contains_key(&a1.id));
        assert!(t.open.contains_key(&a2.id));
        assert_eq!(t.per_peer[&A], 2);
    }

    #[test]
    fn a_peer_whose_connections_are_all_busy_is_refused_while_others_get_in() {
        let c = conns(10, 1);
        let a = admitted(c.admit(A));
        let _r = a.request();
        assert!(matches!(c.admit(A), Admission::Full("peer")));
        let _b = admitted(c.admit(B));
    }

    #[test]
    fn a_request_ending_makes_its_connection_idle_and_closable_again() {
        let c = conns(1, 1);
        let a = admitted(c.admit(A));
        let r = a.request();
        assert!(matches!(c.admit(B), Admission::Full("server")));
        drop(r);
        let _b = admitted(c.admit(B));
        assert!(!c.table().open.contains_key(&a.id));
    }

    #[test]
    fn a_dropped_connection_gives_its_place_and_its_peers_count_back() {
        let c = conns(4, 4);
        let a = admitted(c.admit(A));
        drop(a);
        assert_eq!(c.open(), 0);
        assert!(c.table().per_peer.is_empty());
    }

    fn block_on<F: std::future::Future>(f: F) -> F::Output {
        tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .unwrap()
            .block_on(f)
    }

    #[test]
    fn an_idle_connection_must_close_after_its_deadline_and_a_busy_one_does_not() {
        let c = Conns::new(Limits {
            total: 4,
            per_peer: 4,
            idle: Duration::from_millis(200),
            min_idle: Duration::from_millis(20),
        });
        let idle = admitted(c.admit(A));
        let busy = admitted(c.admit(A));
        let _r = busy.request();
        let t0 = Instant::now();
        block_on(idle.must_close());
        assert!(t0.elapsed() >= Duration::from_millis(200));
        assert_eq!(c.open(), 1);
        let waited = block_on(async {
            tokio::time::timeout(Duration::from_millis(600), busy.must_close()).await
        });
        assert!(waited.is_err(), "a busy connection was closed");
    }

    #[test]
    fn a_connection_closed_to_make_room_is_told_at_once() {
        let c = conns(1, 1);
        let old = admitted(c.admit(A));
        let _new = admitted(c.admit(B));
        let t0 = Instant::now();
        block_on(old.must_close());
        assert!(t0.elapsed() < Duration::from_secs(1));
    }
}
