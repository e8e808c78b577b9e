//! llama-perplexity's logits file (its `--kl-divergence-base FILE`): every scored token's
//! next-token distribution of one run, so that another run — of another quantization, another
//! cache, or the other tool — can be compared with it token by token (`--kl-divergence`).
//! kvchat writes and reads the same bytes as llama.cpp's `tools/perplexity/perplexity.cpp`, so
//! either tool's file is the other's base.
//!
//! Layout (little-endian):
//!
//! ```text
//! "_logits_"  u32 n_ctx  i32 n_vocab  i32 n_chunk  i32 tokens[n_chunk · n_ctx]
//! then for each chunk, for each of its n_ctx − 1 − n_ctx/2 scored tokens, nv = 2·⌈n_vocab/2⌉ + 4 u16:
//!     f32 scale, f32 min_log_prob                (the first 4 u16)
//!     u16 q[n_vocab] (+ one u16 of padding when n_vocab is odd)
//!     log p_i = scale · q_i + min_log_prob        (q_i = 0: log p_i is at most min_log_prob)
//! ```
//!
//! `tokens` are the text's tokens with the model's BOS in front (the chunks are cut from them
//! and each chunk's first token is then made BOS); min_log_prob is the smallest log-probability
//! above max − 16, and scale spreads the range up to the largest over 65,535 steps.

use crate::interrupt::TempFile;
use anyhow::{bail, Context, Result};
use std::io::{BufReader, BufWriter, Read, Write};
use std::path::{Path, PathBuf};

const MAGIC: &[u8; 8] = b"_logits_";
/// Bytes before the tokens: the magic, n_ctx, n_vocab and n_chunk.
const HEADER_BYTES: u64 = 8 + 4 + 4 + 4;
/// log-probabilities this far below the largest are all stored as the floor (llama.cpp's 16).
const RANGE: f64 = 16.0;

/// u16 per stored token for a vocabulary of `n_vocab` (llama.cpp's `nv`).
fn row_len(n_vocab: usize) -> usize {
    2 * n_vocab.div_ceil(2) + 4
}

/// Tokens each chunk of `n_ctx` scores (positions n_ctx/2 .. n_ctx − 2 predict the next one).
pub fn scored_per_chunk(n_ctx: usize) -> usize {
    n_ctx - 1 - n_ctx / 2
}

/// One distribution as llama.cpp stores it: `row` (len `row_len`) from log-probabilities.
pub fn encode(log_probs: &[f64], row: &mut [u16]) {
    let max = log_probs.iter().fold(f64::NEG_INFINITY, |m, &x| m.max(x));
    let min = log_probs
        .iter()
        .fold(f64::INFINITY, |m, &x| m.min(x))
        .max(max - RANGE);
    let scale = ((max - min) / 65535.0) as f32;
    let floor = min as f32;
    row[..2].copy_from_slice(&to_u16s(scale));
    row[2..4].copy_from_slice(&to_u16s(floor));
    let q = &mut row[4..];
    q.fill(0);
    if scale > 0.0 {
        let inv = 1.0 / scale as f64;
        for (q, &lp) in q.iter_mut().zip(log_probs) {
            if lp > min {
                *q = ((lp - min) * inv).round().min(65535.0) as u16;
            }
        }
    }
}

/// The log-probabilities `row` holds (one per vocabulary entry).
pub fn decode(row: &[u16], n_vocab: usize, out: &mut Vec<f64>) {
    let scale = from_u16s(&row[..2]) as f64;
    let floor = from_u16s(&row[2..4]) as f64;
    out.clear();
    out.extend(
        row[4..4 + n_vocab]
            .iter()
            .map(|&q| scale * q as f64 + floor),
    );
}

/// An f32 as the two u16 llama.cpp's file holds it in (its bytes, in order).
fn to_u16s(x: f32) -> [u16; 2] {
    let b = x.to_le_bytes();
    [
        u16::from_le_bytes([b[0], b[1]]),
        u16::from_le_bytes([b[2], b[3]]),
    ]
}

fn from_u16s(u: &[u16]) -> f32 {
    let (a, b) = (u[0].to_le_bytes(), u[1].to_le_bytes());
    f32::from_le_bytes([a[0], a[1], b[0], b[1]])
}

/// The size a file of these dimensions has, or None if it overflows.
fn file_bytes(n_ctx: usize, n_vocab: usize, n_chunk: usize) -> Option<u64> {
    let tokens = (n_chunk as u64).checked_mul(n_ctx as u64)?.checked_mul(4)?;
    let rows = (n_chunk as u64)
        .checked_mul(scored_per_chunk(n_ctx) as u64)?
        .checked_mul(row_len(n_vocab) as u64)?
        .checked_mul(2)?;
    HEADER_BYTES.checked_add(tokens)?.checked_add(rows)
}

/// Writes a logits file as a run scores its tokens; it appears at its path, complete, only when
/// [`Writer::finish`] is called (until then it is a temporary file beside it, removed on failure).
pub struct Writer {
    path: PathBuf,
    tmp: TempFile,
    out: BufWriter<std::fs::File>,
    n_vocab: usize,
    row: Vec<u16>,
    bytes: Vec<u8>,
    left: usize,
}

impl Writer {
    /// Fails if `path` already exists (kvchat never overwrites what a user has) or its directory
    /// does not.
    pub fn check_target(path: &Path) -> Result<()> {
        match std::fs::symlink_metadata(path) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => bail!("cannot check --kl-divergence-base {}: {e}", path.display()),
            Ok(_) => bail!(
                "--kl-divergence-base {} already exists; kvchat will not overwrite it (remove it or name another file; add --kl-divergence to compare with it)",
                path.display()
            ),
        }
        let dir = path
            .parent()
            .filter(|p| !p.as_os_str().is_empty())
            .unwrap_or(Path::new("."));
        if !dir.is_dir() {
            bail!(
                "--kl-divergence-base {}: the directory {} does not exist",
                path.display(),
                dir.display()
            );
        }
        Ok(())
    }

    /// Starts the file for `n_chunk` chunks of `n_ctx` of `stream` (the text's tokens after BOS).
    pub fn create(path: &Path, n_ctx: usize, n_vocab: usize, stream: &[u32]) -> Result<Self> {
        Self::check_target(path)?;
        let n_chunk = stream.len() / n_ctx;
        let dims = |x: usize, what: &str| {
            i32::try_from(x)
                .with_context(|| format!("{what} {x} does not fit llama.cpp's logits file"))
        };
        let (ctx32, vocab32, chunk32) = (
            dims(n_ctx, "a chunk of")? as u32,
            dims(n_vocab, "a vocabulary of")?,
            dims(n_chunk, "a count of chunks")?,
        );
        let (tmp, f) = TempFile::beside(path).with_context(|| {
            format!(
                "cannot write a temporary file beside --kl-divergence-base {}",
                path.display()
            )
        })?;
        let mut out = BufWriter::with_capacity(1 << 20, f);
        let mut head = Vec::with_capacity(HEADER_BYTES as usize + 4 * n_chunk * n_ctx);
        head.extend_from_slice(MAGIC);
        head.extend_from_slice(&ctx32.to_le_bytes());
        head.extend_from_slice(&vocab32.to_le_bytes());
        head.extend_from_slice(&chunk32.to_le_bytes());
        for &t in &stream[..n_chunk * n_ctx] {
            head.extend_from_slice(&t.to_le_bytes());
        }
        out.write_all(&head)
            .with_context(|| format!("cannot write {}", tmp.path().display()))?;
        Ok(Self {
            path: path.to_path_buf(),
            tmp,
            out,
            n_vocab,
            row: vec![0; row_len(n_vocab)],
            bytes: Vec::with_capacity(2 * row_len(n_vocab)),
            left: n_chunk * scored_per_chunk(n_ctx),
        })
    }

    /// The next scored token's log-probabilities.
    pub fn token(&mut self, log_probs: &[f64]) -> Result<()> {
        if log_probs.len() != self.n_vocab || self.left == 0 {
            bail!(
                "internal: a logits file of {} more tokens over {} got one over {}",
                self.left,
                self.n_vocab,
                log_probs.len()
            );
        }
        encode(log_probs, &mut self.row);
        self.bytes.clear();
        self.bytes
            .extend(self.row.iter().flat_map(|q| q.to_le_bytes()));
        self.out
            .write_all(&self.bytes)
            .with_context(|| format!("cannot write {}", self.tmp.path().display()))?;
        self.left -= 1;
        Ok(())
    }

    /// Flushes the file and moves it to its path (still refusing one that appeared meanwhile).
    pub fn finish(self) -> Result<()> {
        if self.left != 0 {
            bail!("internal: a logits file is {} tokens short", self.left);
        }
        let f = self
            .out
            .into_inner()
            .map_err(|e| e.into_error())
            .and_then(|f| f.sync_all().map(|()| f))
            .with_context(|| format!("cannot write {}", self.tmp.path().display()))?;
        drop(f);
        Self::check_target(&self.path)?;
        self.tmp.keep(&self.path)
    }
}

/// Reads a logits file written by llama-perplexity or kvchat, one scored token at a time, after
/// checking that its size is the one its header states (a file cut short, or not this format,
/// is refused before any scoring).
pub struct Reader {
    path: PathBuf,
    input: BufReader<std::fs::File>,
    pub n_ctx: usize,
    pub n_vocab: usize,
    pub n_chunk: usize,
    /// The text's tokens, BOS first: the chunks are cut from them.
    pub tokens: Vec<u32>,
    bytes: Vec<u8>,
    row: Vec<u16>,
}

impl Reader {
    pub fn open(path: &Path) -> Result<Self> {
        let what = "--kl-divergence-base";
        let f = crate::fsx::open_regular_nofollow(path)
            .with_context(|| format!("cannot read {what} {}", path.display()))?;
        let size = f.metadata()?.len();
        let mut input = BufReader::with_capacity(1 << 20, f);
        let mut head = [0u8; HEADER_BYTES as usize];
        let not_ours = || {
            anyhow::anyhow!(
                "{what} {} is not a logits file (llama-perplexity's --kl-divergence-base, or kvchat ppl's)",
                path.display()
            )
        };
        input.read_exact(&mut head).map_err(|_| not_ours())?;
        if &head[..8] != MAGIC {
            return Err(not_ours());
        }
        let word = |i: usize| u32::from_le_bytes(head[i..i + 4].try_into().expect("4 bytes"));
        let (n_ctx, n_vocab, n_chunk) = (word(8), word(12) as i32, word(16) as i32);
        if !(4..=1 << 24).contains(&n_ctx) || n_vocab <= 0 || n_chunk <= 0 {
            bail!(
                "{what} {}: its header states chunks of {n_ctx} tokens, a vocabulary of {n_vocab} and {n_chunk} chunks; a logits file has chunks of at least 4 and at least one token and chunk",
                path.display()
            );
        }
        let (n_ctx, n_vocab, n_chunk) = (n_ctx as usize, n_vocab as usize, n_chunk as usize);
        match file_bytes(n_ctx, n_vocab, n_chunk) {
            Some(want) if want == size => {}
            want => bail!(
                "{what} {} is {size} bytes; {n_chunk} chunk(s) of {n_ctx} tokens over a vocabulary of {n_vocab} take {} (cut short, or not a logits file)",
                path.display(),
                want.map_or("more than a file can hold".into(), |w| format!("{w} bytes"))
            ),
        }
        let mut bytes = vec![0u8; 4 * n_chunk * n_ctx];
        input
            .read_exact(&mut bytes)
            .with_context(|| format!("cannot read {what} {}", path.display()))?;
        let tokens: Vec<u32> = bytes
            .chunks_exact(4)
            .map(|b| u32::from_le_bytes(b.try_into().expect("4 bytes")))
            .collect();
        if let Some((i, t)) = tokens
            .iter()
            .enumerate()
            .find(|(_, &t)| t as usize >= n_vocab)
        {
            bail!(
                "{what} {}: token {i} is id {}, outside its vocabulary of {n_vocab}",
                path.display(),
                *t as i32
            );
        }
        Ok(Self {
            path: path.to_path_buf(),
            input,
            n_ctx,
            n_vocab,
            n_chunk,
            tokens,
            bytes: vec![0; 2 * row_len(n_vocab)],
            row: vec![0; row_len(n_vocab)],
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The next scored token's log-probabilities, into `out`.
    pub fn next_into(&mut self, out: &mut Vec<f64>) -> Result<()> {
        self.input
            .read_exact(&mut self.bytes)
            .with_context(|| format!("cannot read --kl-divergence-base {}", self.path.display()))?;
        for (q, b) in self.row.iter_mut().zip(self.bytes.chunks_exact(2)) {
            *q = u16::from_le_bytes([b[0], b[1]]);
        }
        let (scale, floor) = (from_u16s(&self.row[..2]), from_u16s(&self.row[2..4]));
        if !(scale.is_finite() && scale >= 0.0 && floor.is_finite()) {
            bail!(
                "--kl-divergence-base {}: a stored distribution has scale {scale} and floor {floor} (not a logits file, or damaged)",
                self.path.display()
            );
        }
        decode(&self.row, self.n_vocab, out);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn log_softmax(logits: &[f64]) -> Vec<f64> {
        let max = logits.iter().fold(f64::NEG_INFINITY, |m, &x| m.max(x));
        let lse = logits.iter().map(|x| (x - max).exp()).sum::<f64>().ln() + max;
        logits.iter().map(|x| x - lse).collect()
    }

    #[test]
    fn a_stored_distribution_keeps_every_log_prob_within_the_range_over_65535_steps() {
        let lp = log_softmax(&[3.0, -1.0, 0.5, 2.25, -30.0]);
        let mut row = vec![0u16; row_len(5)];
        encode(&lp, &mut row);
        assert_eq!(row.len(), 10); // 2·3 + 4: odd vocabularies are padded
        let mut back = Vec::new();
        decode(&row, 5, &mut back);
        let step = 16.0 / 65535.0;
        for i in 0..4 {
            assert!(
                (back[i] - lp[i]).abs() <= step,
                "{i}: {} vs {}",
                back[i],
                lp[i]
            );
        }
        // Below the largest − 16: stored as the floor.
        assert!((back[4] - (lp[0] - 16.0)).abs() < 1e-5, "{}", back[4]);
        assert_eq!(row[4 + 4], 0);
        assert_eq!(row[4], 65535);
    }

    #[test]
    fn the_header_states_the_f32_scale_and_floor_in_the_first_four_u16() {
        let lp = log_softmax(&[1.0, 0.0]);
        let mut row = vec![0u16; row_len(2)];
        encode(&lp, &mut row);
        assert_eq!(from_u16s(&row[..2]), ((lp[0] - lp[1]) / 65535.0) as f32);
        assert_eq!(from_u16s(&row[2..4]), lp[1] as f32);
        assert_eq!(&row[4..], &[65535, 0]);
    }

    #[test]
    fn a_file_is_its_header_its_tokens_and_its_rows_in_bytes() {
        // 2 chunks of 8: 3 scored tokens each, 5 + 4 u16 per token.
        assert_eq!(scored_per_chunk(8), 3);
        assert_eq!(file_bytes(8, 5, 2), Some(20 + 2 * 8 * 4 + 2 * 3 * 10 * 2));
        assert_eq!(
            file_bytes(1 << 24, i32::MAX as usize, i32::MAX as usize),
            None
        );
    }

    fn temp_path(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("kvchat-logits-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d.join("base.kld")
    }

    #[test]
    fn what_the_writer_writes_the_reader_reads_back() {
        let path = temp_path("roundtrip");
        let stream: Vec<u32> = (0..17).map(|i| i % 5).collect(); // 2 chunks of 8, one left over
        let rows: Vec<Vec<f64>> = (0..6)
            .map(|k| log_softmax(&[k as f64, 1.0, -2.0, 0.5, -0.25]))
            .collect();
        let mut w = Writer::create(&path, 8, 5, &stream).unwrap();
        for r in &rows {
            w.token(r).unwrap();
        }
        // Not at its path until finished.
        assert!(!path.exists());
        w.finish().unwrap();
        assert_eq!(
            std::fs::metadata(&path).unwrap().len(),
            file_bytes(8, 5, 2).unwrap()
        );
        let mut r = Reader::open(&path).unwrap();
        assert_eq!((r.n_ctx, r.n_vocab, r.n_chunk), (8, 5, 2));
        assert_eq!(r.tokens, &stream[..16]);
        let mut got = Vec::new();
        for want in &rows {
            r.next_into(&mut got).unwrap();
            for (a, b) in got.iter().zip(want) {
                assert!((a - b).abs() <= 16.0 / 65535.0, "{a} vs {b}");
            }
        }
    }

    #[test]
    fn a_writer_refuses_a_path_that_exists() {
        let path = temp_path("exists");
        std::fs::write(&path, b"mine").unwrap();
        let e = Writer::create(&path, 8, 5, &[0; 8])
            .err()
            .unwrap()
            .to_string();
        assert!(
            e.contains("already exists") && e.contains("base.kld"),
            "{e}"
        );
        assert_eq!(std::fs::read(&path).unwrap(), b"mine");
    }

    #[test]
    fn a_writer_that_is_not_finished_leaves_nothing() {
        let path = temp_path("unfinished");
        let w = Writer::create(&path, 8, 5, &[0; 8]).unwrap();
        drop(w);
        assert_eq!(
            std::fs::read_dir(path.parent().unwrap()).unwrap().count(),
            0
        );
    }

    #[test]
    fn a_file_cut_short_is_refused_with_its_size_and_what_its_header_needs() {
        let path = temp_path("short");
        let mut w = Writer::create(&path, 8, 5, &[1; 8]).unwrap();
        for _ in 0..3 {
            w.token(&log_softmax(&[0.0; 5])).unwrap();
        }
        w.finish().unwrap();
        let full = std::fs::read(&path).unwrap();
        std::fs::write(&path, &full[..full.len() - 1]).unwrap();
        let e = Reader::open(&path).err().unwrap().to_string();
        assert!(
            e.contains("is 111 bytes") && e.contains("take 112 bytes"),
            "{e}"
        );
    }

    #[test]
    fn a_token_outside_the_vocabulary_is_refused_naming_it() {
        let path = temp_path("token");
        let mut w = Writer::create(&path, 8, 5, &[0, 1, 2, 3, 4, 0, 1, 2]).unwrap();
        for _ in 0..3 {
            w.token(&log_softmax(&[0.0; 5])).unwrap();
        }
        w.finish().unwrap();
        let mut b = std::fs::read(&path).unwrap();
        b[20 + 4 * 3..20 + 4 * 4].copy_from_slice(&9u32.to_le_bytes());
        std::fs::write(&path, &b).unwrap();
        let e = Reader::open(&path).err().unwrap().to_string();
        assert!(e.contains("token 3 is id 9"), "{e}");
    }

    #[test]
    fn a_file_of_another_format_is_refused() {
        let path = temp_path("other");
        std::fs::write(&path, b"GGUF\x03\0\0\0 and more bytes").unwrap();
        let e = Reader::open(&path).err().unwrap().to_string();
        assert!(e.contains("is not a logits file"), "{e}");
    }
}
