//! One client cannot starve the others (issue 64): under each flood a hostile client can raise
//! against `kvchat serve` — idle sockets past the connection cap, request heads trickled forever,
//! large bodies held open, bodies trickled a byte at a time, requests that cost work before they
//! are admitted — an ordinary 4-token request on a new connection still answers within 2 s; the
//! server's memory stays under 1.5 GB and comes back to within 10 % of its idle figure; nothing a
//! client did wrong gets a 5xx; and the pool is empty again afterwards. Raw sockets on 127.0.0.1,
//! bounded in count and time.

use crate::common::server::{greedy_chat, Server};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How long an ordinary request may take while a flood goes on.
const ANSWERS_WITHIN: Duration = Duration::from_secs(2);
/// The server's resident memory may never pass this.
const MEMORY_CEILING_KIB: u64 = 1_500_000;
/// More than the server keeps open at once (512).
const PAST_THE_CAP: usize = 530;

/// A connection to `server` from `from` (an address of 127.0.0.0/8): another client, to the
/// server, than the tests' own requests from 127.0.0.1.
fn connect_from(from: &str, server: &Server) -> TcpStream {
    use socket2::{Domain, Socket, Type};
    let to: SocketAddr = server.addr().parse().unwrap();
    let from: SocketAddr = format!("{from}:0").parse().unwrap();
    let s = Socket::new(Domain::IPV4, Type::STREAM, None).unwrap();
    s.bind(&from.into()).unwrap();
    s.connect(&to.into()).unwrap();
    s.into()
}

/// A server, warmed by one answer, and its resident memory then (KiB).
fn warm_server() -> (Server, u64) {
    let server = Server::start(&["--ctx", "512"]);
    ordinary_request(&server);
    let idle = server.memory_kib("VmRSS");
    (server, idle)
}

/// A 4-token chat on a connection of its own: it must answer 200 within [`ANSWERS_WITHIN`].
fn ordinary_request(server: &Server) -> Duration {
    let t0 = Instant::now();
    let (code, v, _) = server.post(
        "/v1/chat/completions",
        &greedy_chat("Say hello.", 4).to_string(),
        None,
    );
    let took = t0.elapsed();
    assert_eq!(code, 200, "{v}");
    assert!(
        took < ANSWERS_WITHIN,
        "an ordinary request took {took:?} under the flood"
    );
    took
}

/// After a flood: the pool empty, no panic, the peak under the ceiling, and resident memory back
/// within 10 % of `idle` (given a few seconds to settle).
fn assert_recovers(server: &Server, idle: u64, case: &str, took: Duration) {
    server.assert_settles();
    let peak = server.memory_kib("VmHWM");
    assert!(
        peak < MEMORY_CEILING_KIB,
        "the server's memory peaked at {peak} KiB"
    );
    let t0 = Instant::now();
    loop {
        let now = server.memory_kib("VmRSS");
        if now as f64 <= idle as f64 * 1.10 {
            // The figures, for the record (`-- --nocapture`).
            eprintln!(
                "flood {case}: an ordinary request answered in {} ms; memory idle {} MB, peak {} MB, after {} MB",
                took.as_millis(),
                idle / 1000,
                peak / 1000,
                now / 1000
            );
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "resident memory stayed at {now} KiB after the flood (idle: {idle} KiB)"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    // And it still answers.
    let _ = ordinary_request(server);
}

/// The status code of whatever answer `conn` got, if any (a reset or silence: None).
fn status_of(conn: &mut TcpStream) -> Option<u16> {
    conn.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    let mut head = [0u8; 12];
    conn.read_exact(&mut head).ok()?;
    std::str::from_utf8(&head[9..12]).ok()?.parse().ok()
}

/// Whether the server has closed `conn` (reads end or fail at once).
fn is_closed(mut conn: &TcpStream) -> bool {
    conn.set_read_timeout(Some(Duration::from_millis(1)))
        .unwrap();
    let mut byte = [0u8; 1];
    match conn.read(&mut byte) {
        Ok(0) => true,
        Ok(_) => false,
        Err(e) => !matches!(
            e.kind(),
            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
        ),
    }
}

#[test]
fn idle_sockets_past_the_cap_give_way_to_a_new_client() {
    let (server, idle) = warm_server();
    // 540 sockets from three addresses, 180 each: under one peer's cap, past the server's.
    let flood: Vec<TcpStream> = (0..540)
        .map(|i| connect_from(["127.0.0.2", "127.0.0.3", "127.0.0.4"][i % 3], &server))
        .collect();
    std::thread::sleep(Duration::from_millis(300));
    let took = ordinary_request(&server);
    // The oldest idle sockets were closed to make room.
    let closed = flood.iter().filter(|c| is_closed(c)).count();
    assert!(closed > 540 - 512, "only {closed} idle sockets were closed");
    drop(flood);
    assert_recovers(&server, idle, "of idle sockets", took);
}

#[test]
fn one_client_past_its_share_of_idle_sockets_closes_its_own() {
    let (server, idle) = warm_server();
    let flood: Vec<TcpStream> = (0..PAST_THE_CAP)
        .map(|_| connect_from("127.0.0.2", &server))
        .collect();
    std::thread::sleep(Duration::from_millis(300));
    let took = ordinary_request(&server);
    // One address keeps at most half the places (256): the rest of its sockets were closed.
    let closed = flood.iter().filter(|c| is_closed(c)).count();
    assert!(
        closed >= PAST_THE_CAP - 256,
        "only {closed} of one client's idle sockets were closed"
    );
    drop(flood);
    assert_recovers(&server, idle, "of one client's idle sockets", took);
}

#[test]
fn request_heads_trickled_forever_give_way_to_a_new_client() {
    let (server, idle) = warm_server();
    let mut flood: Vec<TcpStream> = (0..PAST_THE_CAP)
        .map(|i| connect_from(["127.0.0.2", "127.0.0.3", "127.0.0.4"][i % 3], &server))
        .collect();
    for conn in &mut flood {
        let _ = conn.write_all(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nX-Slow: a");
    }
    std::thread::sleep(Duration::from_millis(300));
    let took = ordinary_request(&server);
    // A byte more on each: a head never finished keeps no one out.
    for conn in &mut flood {
        let _ = conn.write_all(b"a");
    }
    let took = took.max(ordinary_request(&server));
    drop(flood);
    assert_recovers(&server, idle, "of trickled request heads", took);
}

/// Opens `n` connections that each send a large body but its last byte (announced with a length,
/// or chunked) and hold it; returns their statuses once `release` fires (None: no answer yet or
/// a reset, as for a connection refused while still sending).
fn held_bodies(
    server: &Server,
    n: usize,
    chunked: bool,
    release: Arc<std::sync::Barrier>,
) -> Vec<std::thread::JoinHandle<Option<u16>>> {
    let len = (8 << 20) - 1;
    let body = Arc::new(vec![b'x'; len - 1]);
    (0..n)
        .map(|_| {
            let (addr, body, release) = (server.addr(), body.clone(), release.clone());
            std::thread::spawn(move || {
                let mut conn = TcpStream::connect(&addr).unwrap();
                conn.set_write_timeout(Some(Duration::from_secs(10)))
                    .unwrap();
                let head = if chunked {
                    format!("POST /v1/chat/completions HTTP/1.1\r\nHost: {addr}\r\nTransfer-Encoding: chunked\r\n\r\n{len:x}\r\n")
                } else {
                    format!("POST /v1/chat/completions HTTP/1.1\r\nHost: {addr}\r\nContent-Length: {len}\r\n\r\n")
                };
                let _ = conn
                    .write_all(head.as_bytes())
                    .and_then(|()| conn.write_all(&body));
                release.wait();
                // The server's answer, where it gave one before the body was finished.
                conn.set_nonblocking(true).unwrap();
                let mut head = [0u8; 12];
                let answered = conn.peek(&mut head).is_ok_and(|n| n == 12);
                conn.set_nonblocking(false).unwrap();
                answered.then(|| status_of(&mut conn)).flatten()
            })
        })
        .collect()
}

#[test]
fn large_bodies_held_open_cost_a_bounded_budget_not_their_count() {
    let (server, idle) = warm_server();
    let release = Arc::new(std::sync::Barrier::new(201));
    let mut senders = held_bodies(&server, 100, false, release.clone());
    senders.extend(held_bodies(&server, 100, true, release.clone()));
    // Every sender has sent what it will (or been refused) after the budget's wait.
    std::thread::sleep(Duration::from_millis(2500));
    let during = server.memory_kib("VmRSS");
    let took = ordinary_request(&server);
    release.wait();
    let statuses: Vec<Option<u16>> = senders.into_iter().map(|t| t.join().unwrap()).collect();
    // Those past the budget were told 503 (a capacity answer, with Retry-After), never a 5xx of
    // another kind; the rest still wait for their last byte.
    for s in statuses.iter().flatten() {
        assert_eq!(*s, 503, "a held body was answered {s}");
    }
    assert!(
        statuses.iter().flatten().count() >= 150,
        "too few bodies were refused: {statuses:?}"
    );
    // 200 bodies of 8 MiB would be 1.6 GB; the budget is 64 MiB.
    assert!(
        during < idle + 200_000,
        "holding 200 large bodies took the server from {idle} to {during} KiB"
    );
    eprintln!(
        "flood of held bodies: {} of 200 refused with 503 while sending, memory then {} MB",
        statuses.iter().flatten().count(),
        during / 1000
    );
    assert_recovers(&server, idle, "of held bodies", took);
}

#[test]
fn bodies_trickled_a_byte_at_a_time_hold_one_clients_share_not_the_server() {
    let (server, idle) = warm_server();
    // Every socket busy (a request in flight) and none idle to close: one address past its cap.
    let mut flood = Vec::new();
    for i in 0..PAST_THE_CAP {
        if i == 256 {
            // Once the server has read the first 256 heads, those sockets are busy (the count
            // includes the /metrics request asking).
            server.wait_until("kvchat_connections_busy", 257.0, 30, "the heads read");
        }
        let mut conn = connect_from("127.0.0.2", &server);
        let _ = conn.write_all(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{",
        );
        flood.push(conn);
    }
    for _ in 0..3 {
        std::thread::sleep(Duration::from_millis(100));
        for conn in &mut flood {
            let _ = conn.write_all(b" ");
        }
    }
    let took = ordinary_request(&server);
    // Past its 256 places the client was told 503 with Retry-After, not reset.
    let full = flood
        .iter()
        .filter(|c| {
            let mut c: &TcpStream = c;
            let mut answer = String::new();
            c.set_read_timeout(Some(Duration::from_millis(50))).unwrap();
            let _ = c.read_to_string(&mut answer);
            answer.starts_with("HTTP/1.1 503") && answer.contains("retry-after: 1")
        })
        .count();
    assert_eq!(full, PAST_THE_CAP - 256, "sockets told the server is full");
    drop(flood);
    assert_recovers(&server, idle, "of trickled bodies", took);
}

#[test]
fn requests_that_would_cost_work_before_admission_are_refused_by_count_while_others_answer() {
    let (server, idle) = warm_server();
    // 289,260 empty messages: no content bytes, ~8 MB of JSON.
    let empty = format!(
        r#"{{"messages":[{}]}}"#,
        vec![r#"{"role":"user","content":""}"#; 289_260].join(",")
    );
    let empty = Arc::new(empty);
    let floods: Vec<_> = (0..4)
        .map(|_| {
            let (addr, body) = (server.base.clone(), empty.clone());
            std::thread::spawn(move || {
                let r = ureq::post(&format!("{addr}/v1/chat/completions"))
                    .set("Content-Type", "application/json")
                    .send_string(&body);
                match r {
                    Err(ureq::Error::Status(code, r)) => (code, r.into_string().unwrap()),
                    Ok(r) => (r.status(), r.into_string().unwrap()),
                    Err(e) => panic!("{e}"),
                }
            })
        })
        .collect();
    std::thread::sleep(Duration::from_millis(100));
    let took = ordinary_request(&server);
    for f in floods {
        let (code, text) = f.join().unwrap();
        assert_eq!(code, 400, "{text}");
        assert!(text.contains("289260 messages"), "{text}");
    }
    assert_recovers(&server, idle, "of 289,260-message requests", took);
}

#[test]
fn large_bodies_of_tiny_json_values_cost_their_bytes_not_their_values() {
    let (server, idle) = warm_server();
    // 8 MiB of `{}`: ~270 MB each if read into JSON values. Beside the fields kvchat reads they
    // are read past; inside one (a tool's schema) they are counted and refused before any is made.
    let filler = vec!["{}"; ((8 << 20) - 300) / 3].join(",");
    let user = r#"[{"role":"user","content":"hi"}]"#;
    let beside = format!(r#"{{"messages":{user},"max_tokens":1,"x":[{filler}]}}"#);
    let inside = format!(
        r#"{{"messages":{user},"max_tokens":1,"tools":[{{"type":"function","function":{{"name":"f","parameters":{{"x":[{filler}]}}}}}}]}}"#
    );
    // The same through Anthropic's Messages API, whose reading shares the counts and the budget.
    let beside_m = format!(r#"{{"messages":{user},"max_tokens":1,"x":[{filler}]}}"#);
    let inside_m = format!(
        r#"{{"messages":{user},"max_tokens":1,"tools":[{{"name":"f","input_schema":{{"x":[{filler}]}}}}]}}"#
    );
    let bodies = [
        ("/v1/chat/completions", Arc::new(beside)),
        ("/v1/chat/completions", Arc::new(inside)),
        ("/v1/messages", Arc::new(beside_m)),
        ("/v1/messages", Arc::new(inside_m)),
    ];
    let floods: Vec<_> = (0..8)
        .map(|i| {
            let (path, body) = (bodies[i % 4].0, bodies[i % 4].1.clone());
            let addr = server.base.clone();
            std::thread::spawn(move || {
                let r = ureq::post(&format!("{addr}{path}"))
                    .set("Content-Type", "application/json")
                    .send_string(&body);
                let (code, text) = match r {
                    Err(ureq::Error::Status(code, r)) => (code, r.into_string().unwrap()),
                    Ok(r) => (r.status(), r.into_string().unwrap()),
                    Err(e) => panic!("{e}"),
                };
                (i % 2, code, text)
            })
        })
        .collect();
    std::thread::sleep(Duration::from_millis(100));
    let took = ordinary_request(&server);
    for f in floods {
        match f.join().unwrap() {
            // Past the body budget a large body may be told to come back (503).
            (0, code, text) => assert!(code == 200 || code == 503, "{code} {text}"),
            (_, code, text) => {
                assert!(code == 400 || code == 503, "{code} {text}");
                assert!(code == 503 || text.contains("JSON values"), "{text}");
            }
        }
    }
    assert_recovers(&server, idle, "of 8 MiB bodies of tiny values", took);
}
