//! The split of one attention over (KV head, tile of query rows, key chunk) work items, and the
//! combination of a row's chunk partials in a fixed order (so the split never changes a result).

use super::super::disjoint::DisjointOut;
use super::*;

/// Keys per softmax chunk. Each row's attention is computed over fixed key ranges 0..C, C..2C, …:
/// per chunk the max m, Σ exp(x − m) and Σ exp(x − m)·v; then the chunks are combined in order. The
/// ranges are the same in a prefill, a decode and a recompute, so results stay bit-identical, while
/// a decode can spread one row's chunks over threads.
pub(super) const CHUNK: usize = 256;

/// One row's output from its chunk partials `[m, s, acc(hd)]` (each `w` = hd + 2 long), in order.
/// A `sink` logit joins the softmax's denominator (no value): Σ_c s_c·e^(m_c−M) + e^(sink−M), M
/// the largest of the chunks' maxima and the sink, as ggml's softmax with sinks.
pub(super) fn combine(partials: &[f32], w: usize, sink: Option<f32>, o: &mut [f32]) {
    let chunks = partials.chunks_exact(w).filter(|p| p[1] > 0.0);
    let m = chunks.clone().fold(f32::NEG_INFINITY, |m, p| m.max(p[0]));
    let m = sink.map_or(m, |x| m.max(x));
    let mut s = sink.map_or(0.0, |x| exp_nonpositive(x - m));
    o.fill(0.0);
    for p in chunks {
        let scale = exp_nonpositive(p[0] - m);
        s += p[1] * scale;
        for (oe, a) in o.iter_mut().zip(&p[2..]) {
            *oe += a * scale;
        }
    }
    let inv = 1.0 / s;
    for oe in o.iter_mut() {
        *oe *= inv;
    }
}

/// One (attention, KV head, tile of rows, key chunk) partial: `(job, h, r0, rows, c, scratch,
/// parts)` writes row r's `[m, s, acc(hd)]` at `parts[r·(hd+2)..]`; `scratch` holds
/// [`scratch_len`] floats of the widest job's hd.
pub(super) type ChunkFn<'a> =
    dyn Fn(usize, usize, usize, usize, usize, &mut [f32], &mut [f32]) + Sync + 'a;

/// A sink logit per query head, and the step's t rows per head: row r of KV head h is query
/// head h·(gt/t) + r/t.
#[derive(Clone, Copy)]
pub(super) struct Sinks<'a> {
    pub logits: &'a [f32],
    pub t: usize,
}

impl Sinks<'_> {
    fn of(s: Option<Self>, gt: usize, h: usize, r: usize) -> Option<f32> {
        s.map(|s| s.logits[h * (gt / s.t) + r / s.t])
    }
}

/// The shape of one attention of a batch: `[nkv, gt]` query rows of `hd`, over `kv_len` keys
/// (virtual: chunks count from the view's shift).
#[derive(Clone, Copy)]
pub(super) struct Job<'a> {
    pub nkv: usize,
    pub gt: usize,
    pub hd: usize,
    pub kv_len: usize,
    pub sinks: Option<Sinks<'a>>,
}

impl Job<'_> {
    fn tiles_per_head(&self) -> usize {
        self.gt.div_ceil(TILE)
    }
    fn tiles(&self) -> usize {
        self.nkv * self.tiles_per_head()
    }
    fn chunks(&self) -> usize {
        self.kv_len.div_ceil(CHUNK)
    }
    /// Tile `i` of this job: (KV head, first row, rows).
    fn tile(&self, i: usize) -> (usize, usize, usize) {
        let per_head = self.tiles_per_head();
        let (h, r0) = (i / per_head, (i % per_head) * TILE);
        (h, r0, TILE.min(self.gt - r0))
    }
}

/// Where item `i` of a list numbered job after job falls: (job, index within it); `firsts` holds
/// each job's first item and the total last.
fn locate(firsts: &[usize], i: usize) -> (usize, usize) {
    let j = firsts.partition_point(|&f| f <= i) - 1;
    (j, i - firsts[j])
}

/// Runs `chunk` over every (tile, key chunk) of every job on candle's pool, in one dispatch, and
/// combines each row's chunks in order into the job's output `[nkv, gt, hd]`. A prefill has
/// plenty of tiles: an item is a tile with all its chunks. A decode has few rows: an item is a
/// (tile, chunk), so one row's keys spread over the threads. The sequences of a batched decode
/// step are jobs of one call, so their small attentions share one dispatch. Every split gives
/// the same bits: a row is computed alone, chunk by chunk, and its chunks combined in order.
pub(super) fn chunked_attention(jobs: &[Job<'_>], chunk: &ChunkFn<'_>) -> Vec<Vec<f32>> {
    let firsts = |n: &dyn Fn(&Job) -> usize| -> Vec<usize> {
        std::iter::once(0)
            .chain(jobs.iter().scan(0, |acc, j| {
                *acc += n(j);
                Some(*acc)
            }))
            .collect()
    };
    let tile_firsts = firsts(&|j| j.tiles());
    let n_tiles = *tile_firsts.last().expect("one entry per job and the total");
    let (hd_max, chunks_max) = jobs
        .iter()
        .fold((0, 0), |(h, c), j| (h.max(j.hd), c.max(j.chunks())));
    let w_max = hd_max + 2;
    let mut outs: Vec<Vec<f32>> = jobs
        .iter()
        .map(|j| vec![0f32; j.nkv * j.gt * j.hd])
        .collect();
    let pool = candle_core::utils::barrier_pool();
    let threads = pool.n_workers() + 1; // the workers and this thread
    if n_tiles >= 4 * threads || jobs.iter().all(|j| j.chunks() <= 1) {
        let dsts: Vec<DisjointOut<f32>> = outs.iter_mut().map(|o| DisjointOut::new(o)).collect();
        pool.execute_chunked(n_tiles, |range| {
            let mut scratch = vec![0f32; scratch_len(hd_max)];
            let mut tmp = vec![0f32; TILE * w_max];
            let mut partials = vec![0f32; TILE * chunks_max * w_max];
            for item in range {
                let (j, i) = locate(&tile_firsts, item);
                let job = &jobs[j];
                let (h, r0, rows) = job.tile(i);
                let (n_chunks, w) = (job.chunks(), job.hd + 2);
                for c in 0..n_chunks {
                    chunk(j, h, r0, rows, c, &mut scratch, &mut tmp);
                    for r in 0..rows {
                        partials[(r * n_chunks + c) * w..][..w]
                            .copy_from_slice(&tmp[r * w..(r + 1) * w]);
                    }
                }
                for r in 0..rows {
                    // SAFETY (DisjointOut's contract): row (h, r0 + r) of job j belongs to this
                    // tile alone.
                    let o = unsafe { dsts[j].slice((h * job.gt + r0 + r) * job.hd, job.hd) };
                    let sink = Sinks::of(job.sinks, job.gt, h, r0 + r);
                    combine(&partials[r * n_chunks * w..][..n_chunks * w], w, sink, o);
                }
            }
        });
    } else {
        let item_firsts = firsts(&|j| j.tiles() * j.chunks());
        let n_items = *item_firsts.last().expect("one entry per job and the total");
        let mut partials: Vec<Vec<f32>> = jobs
            .iter()
            .map(|j| vec![0f32; j.nkv * j.gt * j.chunks() * (j.hd + 2)])
            .collect();
        let dsts: Vec<DisjointOut<f32>> =
            partials.iter_mut().map(|p| DisjointOut::new(p)).collect();
        pool.execute_chunked(n_items, |range| {
            let mut scratch = vec![0f32; scratch_len(hd_max)];
            let mut tmp = vec![0f32; TILE * w_max];
            for item in range {
                let (j, i) = locate(&item_firsts, item);
                let job = &jobs[j];
                let (n_chunks, w) = (job.chunks(), job.hd + 2);
                let c = i % n_chunks;
                let (h, r0, rows) = job.tile(i / n_chunks);
                chunk(j, h, r0, rows, c, &mut scratch, &mut tmp);
                for r in 0..rows {
                    // SAFETY (DisjointOut's contract): partial (row, c) of job j belongs to this
                    // item alone.
                    let part =
                        unsafe { dsts[j].slice(((h * job.gt + r0 + r) * n_chunks + c) * w, w) };
                    part.copy_from_slice(&tmp[r * w..(r + 1) * w]);
                }
            }
        });
        drop(dsts);
        for ((job, out), partials) in jobs.iter().zip(&mut outs).zip(&partials) {
            let (n_chunks, w) = (job.chunks(), job.hd + 2);
            for (row, o) in out.chunks_exact_mut(job.hd).enumerate() {
                let sink = Sinks::of(job.sinks, job.gt, row / job.gt, row % job.gt);
                combine(&partials[row * n_chunks * w..][..n_chunks * w], w, sink, o);
            }
        }
    }
    outs
}
