//! A local stand-in for the Hugging Face hub and a PyPI simple index, on 127.0.0.1.
//!
//! Hub: `GET /{owner}/{name}/resolve/{revision}/{file}` with the headers hf-hub reads (ETag,
//! X-Repo-Commit, Content-Range for `Range` requests, Content-Length); unknown repos answer 401 with
//! `X-Error-Code: RepoNotFound`, unknown files 404 with `EntryNotFound`, as the hub does.
//! Index: `GET /simple/{package}/` lists wheels with `#sha256=` fragments, `GET /files/{wheel}`.
//! Every request is counted; files can be served slowly or cut off mid-body once.

use sha2::{Digest, Sha256};
use std::collections::{HashMap, HashSet};
use std::io::{BufRead, BufReader, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

pub const COMMIT: &str = "0123456789abcdef0123456789abcdef01234567";

#[derive(Default)]
struct State {
    /// repo id → file name → content
    repos: HashMap<String, HashMap<String, Vec<u8>>>,
    /// package (normalized) → [(wheel file name, content)]
    wheels: HashMap<String, Vec<(String, Vec<u8>)>>,
    /// "repo/file" to cut off after half its body, the next time it is fully requested
    drop_once: HashSet<String>,
    /// "repo/file" to send in small slices with pauses (so a progress bar gets drawn)
    slow: HashSet<String>,
    /// Per repo/file: the ETag and X-Repo-Commit headers a hostile server sends instead.
    hostile: HashMap<String, (String, String)>,
}

pub struct Hub {
    pub port: u16,
    pub requests: Arc<AtomicUsize>,
    state: Arc<Mutex<State>>,
}

pub fn sha256_hex(b: &[u8]) -> String {
    format!("{:x}", Sha256::digest(b))
}

impl Hub {
    pub fn start() -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let requests = Arc::new(AtomicUsize::new(0));
        let state = Arc::new(Mutex::new(State::default()));
        let (r, s) = (requests.clone(), state.clone());
        std::thread::spawn(move || {
            for conn in listener.incoming().flatten() {
                let (r, s) = (r.clone(), s.clone());
                std::thread::spawn(move || {
                    let _ = serve(conn, &r, &s);
                });
            }
        });
        Self {
            port,
            requests,
            state,
        }
    }

    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    pub fn add_file(&self, repo: &str, file: &str, content: Vec<u8>) {
        let mut st = self.state.lock().unwrap();
        st.repos
            .entry(repo.to_string())
            .or_default()
            .insert(file.to_string(), content);
    }

    pub fn add_wheel(&self, package: &str, wheel_name: &str, content: Vec<u8>) {
        let mut st = self.state.lock().unwrap();
        st.wheels
            .entry(package.to_string())
            .or_default()
            .push((wheel_name.to_string(), content));
    }

    pub fn drop_once(&self, repo: &str, file: &str) {
        self.state
            .lock()
            .unwrap()
            .drop_once
            .insert(format!("{repo}/{file}"));
    }

    pub fn slow(&self, repo: &str, file: &str) {
        self.state
            .lock()
            .unwrap()
            .slow
            .insert(format!("{repo}/{file}"));
    }

    /// Answers `repo/file` with these ETag and X-Repo-Commit header values (a hostile server).
    pub fn hostile_headers(&self, repo: &str, file: &str, etag: &str, commit: &str) {
        self.state.lock().unwrap().hostile.insert(
            format!("{repo}/{file}"),
            (etag.to_string(), commit.to_string()),
        );
    }

    pub fn request_count(&self) -> usize {
        self.requests.load(Ordering::SeqCst)
    }
}

fn respond(stream: &mut TcpStream, status: &str, headers: &[(&str, String)], body: &[u8]) {
    let mut head = format!("HTTP/1.1 {status}\r\nConnection: close\r\n");
    for (k, v) in headers {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    head.push_str(&format!("Content-Length: {}\r\n\r\n", body.len()));
    let _ = stream.write_all(head.as_bytes());
    let _ = stream.write_all(body);
}

fn serve(
    mut stream: TcpStream,
    requests: &AtomicUsize,
    state: &Mutex<State>,
) -> std::io::Result<()> {
    let mut reader = BufReader::new(stream.try_clone()?);
    let mut line = String::new();
    reader.read_line(&mut line)?;
    let path = line.split_whitespace().nth(1).unwrap_or("/").to_string();
    let mut range: Option<(usize, Option<usize>)> = None;
    loop {
        let mut h = String::new();
        if reader.read_line(&mut h)? == 0 || h == "\r\n" {
            break;
        }
        if let Some((k, v)) = h.split_once(':') {
            if k.eq_ignore_ascii_case("range") {
                let v = v.trim().trim_start_matches("bytes=");
                let (a, b) = v.split_once('-').unwrap_or((v, ""));
                range = Some((a.parse().unwrap_or(0), b.parse().ok()));
            }
        }
    }
    requests.fetch_add(1, Ordering::SeqCst);

    if let Some(rest) = path.strip_prefix("/simple/") {
        let pkg = rest.trim_end_matches('/');
        let st = state.lock().unwrap();
        let Some(wheels) = st.wheels.get(pkg) else {
            respond(&mut stream, "404 Not Found", &[], b"no such project");
            return Ok(());
        };
        let mut html = String::from("<!DOCTYPE html><html><body>\n");
        for (name, content) in wheels {
            html.push_str(&format!(
                "<a href=\"/files/{name}#sha256={}\">{name}</a><br/>\n",
                sha256_hex(content)
            ));
        }
        html.push_str("</body></html>\n");
        respond(
            &mut stream,
            "200 OK",
            &[("Content-Type", "text/html".into())],
            html.as_bytes(),
        );
        return Ok(());
    }
    if let Some(name) = path.strip_prefix("/files/") {
        let st = state.lock().unwrap();
        let found = st
            .wheels
            .values()
            .flatten()
            .find(|(n, _)| n == name)
            .map(|(_, c)| c.clone());
        drop(st);
        match found {
            Some(c) => respond(&mut stream, "200 OK", &[], &c),
            None => respond(&mut stream, "404 Not Found", &[], b"no such file"),
        }
        return Ok(());
    }

    // /{owner}/{name}/resolve/{revision}/{file}
    let parts: Vec<&str> = path.trim_start_matches('/').splitn(5, '/').collect();
    if parts.len() != 5 || parts[2] != "resolve" {
        respond(&mut stream, "404 Not Found", &[], b"not found");
        return Ok(());
    }
    let repo = format!("{}/{}", parts[0], parts[1]);
    let file = parts[4].to_string();
    let (content, drop_now, slow, hostile) = {
        let mut st = state.lock().unwrap();
        let Some(files) = st.repos.get(&repo) else {
            drop(st);
            respond(
                &mut stream,
                "401 Unauthorized",
                &[("X-Error-Code", "RepoNotFound".into())],
                b"Repository not found",
            );
            return Ok(());
        };
        let Some(content) = files.get(&file).cloned() else {
            drop(st);
            respond(
                &mut stream,
                "404 Not Found",
                &[("X-Error-Code", "EntryNotFound".into())],
                b"Entry not found",
            );
            return Ok(());
        };
        let key = format!("{repo}/{file}");
        let metadata_probe = range == Some((0, Some(0)));
        let drop_now = !metadata_probe && st.drop_once.remove(&key);
        let slow = !metadata_probe && st.slow.contains(&key);
        let hostile = st.hostile.get(&key).cloned();
        (content, drop_now, slow, hostile)
    };
    let total = content.len();
    let (start, end) = match range {
        Some((a, b)) => (a.min(total), b.map_or(total, |b| (b + 1).min(total))),
        None => (0, total),
    };
    let body = &content[start..end];
    let (etag, commit) =
        hostile.unwrap_or_else(|| (format!("\"{}\"", sha256_hex(&content)), COMMIT.to_string()));
    let mut head = format!(
        "HTTP/1.1 {}\r\nConnection: close\r\nETag: {etag}\r\nX-Repo-Commit: {commit}\r\nContent-Length: {}\r\n",
        if range.is_some() { "206 Partial Content" } else { "200 OK" },
        body.len()
    );
    if range.is_some() {
        head.push_str(&format!(
            "Content-Range: bytes {start}-{}/{total}\r\n",
            end.saturating_sub(1)
        ));
    }
    head.push_str("\r\n");
    stream.write_all(head.as_bytes())?;
    if drop_now {
        // The connection dies half-way through the body.
        stream.write_all(&body[..body.len() / 2])?;
        stream.flush()?;
        let _ = stream.shutdown(std::net::Shutdown::Both);
        return Ok(());
    }
    if slow {
        for chunk in body.chunks(body.len().div_ceil(40).max(1)) {
            stream.write_all(chunk)?;
            stream.flush()?;
            std::thread::sleep(Duration::from_millis(50));
        }
        return Ok(());
    }
    stream.write_all(body)
}
