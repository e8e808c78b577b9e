use super::*;
use std::path::Path;

const SHAPE: Shape = Shape {
    layers: 2,
    n_kv_heads: 2,
    row_bytes: 8,
    state_bytes: 0,
};

fn tmp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("kvchat-prefix-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

fn store(root: &Path, model: &str, budget: u64) -> PrefixStore {
    let ident = Identity {
        model: model.into(),
        file: format!("/models/{model}.gguf"),
        axes: "all, f16".into(),
    };
    PrefixStore::open(root, ident, SHAPE, budget).unwrap()
}

/// Rows whose every byte says which position, layer, head and part it is.
fn rows(p: Piece) -> BlockRows {
    (0..SHAPE.layers)
        .map(|l| {
            let part = |which: u8| -> Vec<u8> {
                let mut out = Vec::new();
                for h in 0..SHAPE.n_kv_heads {
                    for pos in p.start..p.end() {
                        for b in 0..SHAPE.row_bytes {
                            out.push((pos * 7 + l * 13 + h * 29 + b * 3) as u8 ^ which);
                        }
                    }
                }
                out
            };
            (part(0), part(0xff))
        })
        .collect()
}

/// The rows of positions 0..n as a lookup returns them, per layer `[nkv, n, row]`.
fn expected(n: usize) -> Vec<(Vec<u8>, Vec<u8>)> {
    let all = rows(Piece { start: 0, len: n });
    all.into_iter().collect()
}

fn write_all(s: &PrefixStore, tokens: &[u32], upto: usize, boundaries: &[usize]) -> Written {
    let pieces = s.missing(tokens, upto, boundaries, usize::MAX, &[]);
    s.write(tokens, &pieces, without_states(&pieces))
}

fn without_states(pieces: &[Piece]) -> Vec<PieceRows> {
    pieces
        .iter()
        .map(|&p| PieceRows {
            rows: rows(p),
            states: None,
        })
        .collect()
}

fn prompt(n: usize, seed: u32) -> Vec<u32> {
    (0..n as u32)
        .map(|i| i.wrapping_mul(2654435761) ^ seed)
        .collect()
}

#[test]
fn a_stored_prefix_is_found_again_with_its_rows() {
    let root = tmp("roundtrip");
    let s = store(&root, "m", 1 << 30);
    let t = prompt(200, 1);
    let w = write_all(&s, &t, 200, &[150]);
    // Blocks 0..64, 64..128 and the tail 128..150 (the block 128..192 too).
    assert_eq!((w.blocks, w.problems.len()), (4, 0));
    let f = s.lookup(&t, 199, &[150], &|_| true);
    assert_eq!(f.tokens, 192);
    let f = s.lookup(&t, 160, &[150], &|_| true);
    assert_eq!(f.tokens, 150);
    let want = expected(150);
    for (l, st) in f.layers.iter().enumerate() {
        assert_eq!((&st.k, &st.v), (&want[l].0, &want[l].1), "layer {l}");
        assert_eq!(st.residual_from, 150);
    }
    assert!(f.problems.is_empty());
}

#[test]
fn a_prompt_reuses_only_the_blocks_it_shares() {
    let root = tmp("shares");
    let s = store(&root, "m", 1 << 30);
    let t = prompt(256, 1);
    write_all(&s, &t, 256, &[]);
    let mut other = t.clone();
    other[100] ^= 1; // differs in the second block
    assert_eq!(s.lookup(&other, 255, &[], &|_| true).tokens, 64);
    other[3] ^= 1; // and in the first
    assert_eq!(s.lookup(&other, 255, &[], &|_| true).tokens, 0);
}

#[test]
fn the_same_tokens_under_another_model_or_cache_share_nothing() {
    let root = tmp("identity");
    let t = prompt(128, 1);
    write_all(&store(&root, "a", 1 << 30), &t, 128, &[]);
    assert_eq!(
        store(&root, "b", 1 << 30)
            .lookup(&t, 127, &[], &|_| true)
            .tokens,
        0
    );
    let mut s = store(&root, "a", 1 << 30);
    s.ident.axes = "all, bf16".into();
    assert_eq!(s.lookup(&t, 127, &[], &|_| true).tokens, 0);
}

/// Damages the stored block of positions 0..64 with `f`, then looks the prompt up.
fn damaged(name: &str, f: impl FnOnce(&Path)) -> Found {
    let root = tmp(name);
    let s = store(&root, "m", 1 << 30);
    let t = prompt(128, 1);
    write_all(&s, &t, 128, &[]);
    let first = s.path_of(&s.keys(&t)[0]);
    f(&first);
    let found = s.lookup(&t, 127, &[], &|_| true);
    assert!(!first.exists(), "{name}: the damaged block is removed");
    found
}

#[test]
fn a_bit_flipped_block_is_removed_reported_and_not_used() {
    let f = damaged("flip", |p| {
        let mut b = std::fs::read(p).unwrap();
        let i = b.len() / 2;
        b[i] ^= 0x10;
        std::fs::write(p, b).unwrap();
    });
    assert_eq!(f.tokens, 0);
    assert_eq!(f.problems.len(), 1);
    assert!(
        f.problems[0].text.contains("checksum mismatch"),
        "{}",
        f.problems[0]
    );
}

#[test]
fn a_truncated_block_is_removed_reported_and_not_used() {
    let f = damaged("truncated", |p| {
        let b = std::fs::read(p).unwrap();
        std::fs::write(p, &b[..b.len() - 100]).unwrap();
    });
    assert_eq!((f.tokens, f.problems.len()), (0, 1));
}

#[test]
fn a_zero_length_block_is_removed_reported_and_not_used() {
    let f = damaged("empty", |p| std::fs::write(p, b"").unwrap());
    assert_eq!((f.tokens, f.problems.len()), (0, 1));
    assert!(
        f.problems[0].text.contains("not a kvchat KV block"),
        "{}",
        f.problems[0]
    );
}

#[test]
fn a_block_of_another_model_under_this_models_key_is_foreign() {
    let root = tmp("foreign");
    let t = prompt(128, 1);
    let other = store(&root, "other", 1 << 30);
    write_all(&other, &t, 128, &[]);
    let s = store(&root, "m", 1 << 30);
    let key = s.keys(&t)[0];
    std::fs::copy(other.path_of(&other.keys(&t)[0]), s.path_of(&key)).unwrap();
    let f = s.lookup(&t, 127, &[], &|_| true);
    assert_eq!((f.tokens, f.problems.len()), (0, 1));
    assert!(f.problems[0].text.contains("foreign"), "{}", f.problems[0]);
    assert!(!s.path_of(&key).exists());
}

#[test]
fn the_budget_evicts_the_least_recently_used_blocks_first() {
    let root = tmp("budget");
    let s0 = store(&root, "m", 1 << 30);
    let one = s0.block_bytes(STORE_BLOCK, false);
    // Room for 5 blocks (and a little).
    let s = store(&root, "m", 5 * one + one / 2);
    let (a, b, c) = (prompt(128, 1), prompt(128, 2), prompt(128, 3));
    write_all(&s, &a, 128, &[]);
    std::thread::sleep(Duration::from_millis(20));
    write_all(&s, &b, 128, &[]);
    std::thread::sleep(Duration::from_millis(20));
    // `a` used again: now `b` is the least recently used.
    assert_eq!(s.lookup(&a, 128, &[], &|_| true).tokens, 128);
    std::thread::sleep(Duration::from_millis(20));
    let w = write_all(&s, &c, 128, &[]);
    assert_eq!(w.evicted, 1);
    let (_, n, bytes) = stats(&root);
    assert!(bytes <= 5 * one + one / 2, "{bytes} bytes on disk");
    assert_eq!(n, 5);
    assert_eq!(s.lookup(&a, 128, &[], &|_| true).tokens, 128);
    // A chain goes from its end: b keeps its first block.
    assert_eq!(
        s.lookup(&b, 128, &[], &|_| true).tokens,
        64,
        "b's last block went"
    );
    assert_eq!(s.lookup(&c, 128, &[], &|_| true).tokens, 128);
    assert_eq!(stats(&root).0.evictions, 1);
}

#[test]
fn blocks_that_cannot_fit_the_budget_are_not_written() {
    let root = tmp("tiny-budget");
    let s = store(&root, "m", 100);
    let w = write_all(&s, &prompt(128, 1), 128, &[]);
    assert_eq!(w.blocks, 0);
    assert_eq!(
        w.problems[0].fix,
        Some(crate::Fix::StoreBudget),
        "{:?}",
        w.problems
    );
    assert!(
        w.problems[0].text.contains("budget of 100 B"),
        "{:?}",
        w.problems
    );
}

#[test]
fn a_store_directory_that_is_a_file_is_refused_in_one_line() {
    let root = tmp("file");
    std::fs::write(&root, b"not a directory").unwrap();
    let ident = Identity {
        model: "m".into(),
        file: "m".into(),
        axes: "a".into(),
    };
    let e = PrefixStore::open(&root, ident, SHAPE, 1 << 30).unwrap_err();
    let msg = crate::first_line(e);
    assert!(msg.contains("is a regular file, not a directory"), "{msg}");
    assert_eq!(std::fs::read(&root).unwrap(), b"not a directory");
}

#[test]
fn concurrent_writers_and_readers_see_whole_blocks_or_none() {
    let root = tmp("concurrent");
    let t = prompt(64 * 6, 9);
    let want = expected(64 * 6);
    std::thread::scope(|sc| {
        for w in 0..3 {
            let (root, t) = (root.clone(), t.clone());
            sc.spawn(move || {
                let s = store(&root, "m", 1 << 30);
                for _ in 0..5 {
                    let pieces = s.pieces(t.len(), &[]);
                    let out = s.write(&t, &pieces, without_states(&pieces));
                    assert!(out.problems.is_empty(), "writer {w}: {:?}", out.problems);
                }
            });
        }
        for _ in 0..3 {
            let (root, t, want) = (root.clone(), t.clone(), want.clone());
            sc.spawn(move || {
                let s = store(&root, "m", 1 << 30);
                for _ in 0..20 {
                    let f = s.lookup(&t, t.len(), &[], &|_| true);
                    assert!(f.problems.is_empty(), "{:?}", f.problems);
                    for (l, st) in f.layers.iter().enumerate() {
                        let n = f.tokens;
                        // Head h's rows 0..n are the first n of its rows in `want`.
                        for h in 0..SHAPE.n_kv_heads {
                            let row = SHAPE.row_bytes;
                            let got = &st.k[h * n * row..(h + 1) * n * row];
                            let all = 64 * 6 * row;
                            assert_eq!(got, &want[l].0[h * all..h * all + n * row]);
                        }
                    }
                }
            });
        }
    });
    let s = store(&root, "m", 1 << 30);
    assert_eq!(s.lookup(&t, t.len(), &[], &|_| true).tokens, 64 * 6);
}

#[test]
fn totals_add_up_across_runs() {
    let root = tmp("totals");
    let s = store(&root, "m", 1 << 30);
    let add = Totals {
        lookups: 1,
        prompt_tokens: 100,
        reused_tokens: 90,
        ..Totals::default()
    };
    s.record(&add).unwrap();
    s.record(&add).unwrap();
    let (t, _, _) = stats(&root);
    assert_eq!((t.lookups, t.prompt_tokens, t.reused_tokens), (2, 200, 180));
    assert!((t.hit_rate() - 90.0).abs() < 1e-9);
}

#[test]
fn clear_removes_only_the_named_models_blocks() {
    let root = tmp("clear");
    let t = prompt(128, 1);
    write_all(&store(&root, "alpha", 1 << 30), &t, 128, &[]);
    write_all(&store(&root, "beta", 1 << 30), &t, 128, &[]);
    let (n, _) = clear(&root, Some("alpha.gguf")).unwrap();
    assert_eq!(n, 2);
    assert_eq!(
        store(&root, "alpha", 1 << 30)
            .lookup(&t, 128, &[], &|_| true)
            .tokens,
        0
    );
    assert_eq!(
        store(&root, "beta", 1 << 30)
            .lookup(&t, 128, &[], &|_| true)
            .tokens,
        128
    );
    let listed = list(&root);
    assert_eq!(listed.len(), 1);
    assert_eq!(
        (listed[0].tokens, listed[0].model.as_str()),
        (128, "/models/beta.gguf")
    );
}

#[test]
fn a_link_in_place_of_a_block_is_not_followed_and_its_target_is_untouched() {
    // The link points at the block itself, moved out of the store: valid bytes, reached the
    // wrong way. `damaged` checks that the link is removed, as a damaged block is.
    let mut target = None;
    let found = damaged("link", |p| {
        let outside = p.parent().unwrap().parent().unwrap().join("outside.kvb");
        std::fs::rename(p, &outside).unwrap();
        std::os::unix::fs::symlink(&outside, p).unwrap();
        target = Some((std::fs::read(&outside).unwrap(), outside));
    });
    assert_eq!(found.tokens, 0, "nothing is restored through a link");
    assert_eq!(found.problems.len(), 1, "{:?}", found.problems);
    let (before, outside) = target.unwrap();
    assert_eq!(
        std::fs::read(&outside).unwrap(),
        before,
        "the target is untouched"
    );
}

#[test]
fn a_garbage_totals_file_reads_as_zero_totals() {
    let root = tmp("garbage-totals");
    let s = store(&root, "m", 1 << 30);
    write_all(&s, &prompt(64, 1), 64, &[]);
    std::fs::write(root.join("stats.json"), b"\x00not json{").unwrap();
    let (totals, blocks, bytes) = stats(&root);
    assert_eq!(totals, Totals::default());
    assert_eq!(blocks, 1, "what is on disk is still counted");
    assert!(bytes > 0);
}

/// A store for a model with recurrent states of 40 bytes.
fn store_with_states(root: &Path) -> PrefixStore {
    let ident = Identity {
        model: "hybrid".into(),
        file: "/models/hybrid.gguf".into(),
        axes: "all, f16".into(),
    };
    let shape = Shape {
        state_bytes: 40,
        ..SHAPE
    };
    PrefixStore::open(root, ident, shape, 1 << 30).unwrap()
}

/// Writes `tokens[..upto]`'s missing pieces, with states (every byte the end's position) at the
/// ends in `states_at`.
fn write_with_states(s: &PrefixStore, tokens: &[u32], upto: usize, states_at: &[usize]) -> Written {
    let pieces = s.missing(tokens, upto, &[], usize::MAX, states_at);
    let data = pieces
        .iter()
        .map(|&p| PieceRows {
            rows: rows(p),
            states: states_at
                .contains(&p.end())
                .then(|| vec![p.end() as u8; 40]),
        })
        .collect();
    s.write(tokens, &pieces, data)
}

#[test]
fn a_model_with_states_resumes_only_at_a_block_that_keeps_them() {
    let root = tmp("states-resume");
    let s = store_with_states(&root);
    let t = prompt(256, 11);
    assert_eq!(write_with_states(&s, &t, 256, &[128]).blocks, 4);
    // Four blocks stored, the states only at 128: the lookup stops there, with them.
    let f = s.lookup(&t, 255, &[], &|_| true);
    assert_eq!(f.tokens, 128);
    assert_eq!(f.states, Some(vec![128; 40]));
    assert_eq!(f.layers[1].k, expected(128)[1].0);
}

#[test]
fn a_model_with_states_finds_nothing_where_no_block_keeps_them() {
    let root = tmp("states-none");
    let s = store_with_states(&root);
    let t = prompt(128, 12);
    write_with_states(&s, &t, 128, &[]);
    let f = s.lookup(&t, 128, &[], &|_| true);
    assert_eq!((f.tokens, f.states, f.problems.len()), (0, None, 0));
}

#[test]
fn a_block_stored_without_states_is_written_again_where_the_writer_has_them() {
    let root = tmp("states-add");
    let s = store_with_states(&root);
    let t = prompt(192, 13);
    write_with_states(&s, &t, 192, &[]);
    assert_eq!(
        s.missing(&t, 192, &[], usize::MAX, &[128]),
        [Piece { start: 64, len: 64 }]
    );
    write_with_states(&s, &t, 192, &[128]);
    assert_eq!(s.lookup(&t, 191, &[], &|_| true).tokens, 128);
    // Kept states are never written over by a writer that has none there.
    assert!(s.missing(&t, 192, &[], usize::MAX, &[]).is_empty());
}

#[test]
fn a_block_whose_states_are_cut_short_is_removed_and_never_used() {
    let root = tmp("states-cut");
    let s = store_with_states(&root);
    let t = prompt(64, 14);
    write_with_states(&s, &t, 64, &[64]);
    let path = s.path_of(&s.keys(&t)[0]);
    let mut b = std::fs::read(&path).unwrap();
    // Ten bytes of the states gone, the checksum made again: a size no block of this cache has.
    b.drain(b.len() - 42..b.len() - 32);
    let n = b.len() - 32;
    let sum = <sha2::Sha256 as sha2::Digest>::digest(&b[..n]);
    b.truncate(n);
    b.extend_from_slice(&sum);
    std::fs::write(&path, b).unwrap();
    let f = s.lookup(&t, 64, &[], &|_| true);
    assert_eq!(f.tokens, 0);
    assert!(
        f.problems[0]
            .text
            .contains("not a block of this cache's shape"),
        "{:?}",
        f.problems
    );
    assert!(!path.exists());
}
