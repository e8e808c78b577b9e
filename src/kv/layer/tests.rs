use super::budget::Budgeted;
use super::*;
use crate::kv::test_rope;
use crate::model::kernels::attention::attend_view_observed;

const NKV: usize = 2;
const HD: usize = 64;

fn spec(precision: Precision, retention: Retention) -> LayerSpec {
    LayerSpec {
        precision,
        retention,
        offload: false,
        residual: 8,
        max_positions: 4096,
        attend_window: None,
        grow_by: None,
    }
}

fn layer(precision: Precision, retention: Retention) -> Layer {
    Layer::new(&spec(precision, retention), NKV, HD, None)
}

/// Keys and values for positions `from..from + t`, the same for a position whatever the step.
fn kv(from: usize, t: usize) -> (Tensor, Tensor) {
    kv_salted(from, t, 0.0)
}

/// Keys and values of another sequence for `salt` ≠ 0 (a rejected guess's rows).
fn kv_salted(from: usize, t: usize, salt: f32) -> (Tensor, Tensor) {
    let make = |s: f32| {
        let salt = s + salt;
        let xs: Vec<f32> = (0..NKV)
            .flat_map(|h| {
                (from..from + t).flat_map(move |p| {
                    (0..HD).map(move |c| {
                        ((p * 131 + c * 17 + h * 7) as f32 * 0.618 + salt).sin()
                            * if c % 13 == 5 { 6.0 } else { 1.0 }
                    })
                })
            })
            .collect();
        Tensor::from_vec(xs, (1, NKV, t, HD), &Device::Cpu).unwrap()
    };
    (make(0.0), make(1.7))
}

/// Attention of a fixed query for the step at positions `from..from + t`: the output's bits.
fn step(c: &mut Layer, rope: &Rope, from: usize, t: usize) -> Vec<u32> {
    step_salted(c, rope, from, t, 0.0)
}

/// [`step`] over the rows of [`kv_salted`].
fn step_salted(c: &mut Layer, rope: &Rope, from: usize, t: usize, salt: f32) -> Vec<u32> {
    let (k, v) = kv_salted(from, t, salt);
    let att = c.append(&k, &v, rope).unwrap();
    let q = Tensor::ones((NKV, 2 * t, HD), candle_core::DType::F32, &Device::Cpu).unwrap();
    let rot = |pos: usize| {
        rope.apply(&q.reshape((1, NKV * 2, t, HD)).unwrap(), pos)
            .unwrap()
            .reshape((NKV, 2 * t, HD))
            .unwrap()
    };
    let q0 = rot(att.q_pos);
    let q1 = att.sink_q_pos.map(rot);
    let qs: Vec<&Tensor> = std::iter::once(&q0).chain(q1.as_ref()).collect();
    let observe = att.observe;
    let (out, weights) = attend_view_observed(&qs, &att.view, t, 0.125, None, observe).unwrap();
    drop(att);
    // As the decoder does: the scores to a cache that asked for them.
    if observe > 0 {
        c.observed(&weights).unwrap();
    }
    let xs: Vec<f32> = out.flatten_all().unwrap().to_vec1().unwrap();
    // As the decoder does before the layer's next step (a no-op but with offload).
    c.prefetch().unwrap();
    xs.iter().map(|x| x.to_bits()).collect()
}

/// The outputs of a run of steps of these sizes.
fn run(c: &mut Layer, steps: &[usize]) -> Vec<Vec<u32>> {
    let rope = test_rope(4096, HD);
    let mut pos = c.seen;
    steps
        .iter()
        .map(|&t| {
            let o = step(c, &rope, pos, t);
            pos += t;
            o
        })
        .collect()
}

const STEPS: [usize; 6] = [5, 1, 17, 1, 1, 40];

#[test]
fn a_window_is_the_full_cache_bit_for_bit_until_it_drops_a_position() {
    for p in Precision::ALL {
        let mut full = layer(p, Retention::All);
        let mut win = layer(
            p,
            Retention::Window {
                window: 61,
                sinks: 4,
            },
        );
        assert!(run(&mut full, &STEPS) == run(&mut win, &STEPS), "{p:?}");
        assert_eq!((win.len(), win.seen()), (65, 65));
    }
}

/// The largest difference between two runs' outputs (bits as `step` gives them).
fn max_diff(a: &[Vec<u32>], b: &[Vec<u32>]) -> f32 {
    a.iter()
        .flatten()
        .zip(b.iter().flatten())
        .map(|(x, y)| (f32::from_bits(*x) - f32::from_bits(*y)).abs())
        .fold(
            0.0,
            |m, d| if d.is_nan() { f32::INFINITY } else { m.max(d) },
        )
}

#[test]
fn rows_kept_as_tensors_attend_as_the_cpu_kernel_reads_them_in_place() {
    // The GPU's path (rows as tensors, quantized with candle ops, attention by candle ops,
    // offloaded rows staged from host bytes) run on the CPU, against the CPU's path, for
    // every precision, retention and placement. (On the CPU both rotate quantized rows by
    // the fast transform; another device's matrix product is checked in `attention`.)
    let window = Retention::Window {
        window: 29,
        sinks: 3,
    };
    for p in Precision::ALL {
        for retention in [Retention::All, window, Retention::None] {
            for offload in [false, true] {
                let s = LayerSpec {
                    offload,
                    ..spec(p, retention)
                };
                let mut host = Layer::new(&s, NKV, HD, None);
                let mut tensors = Layer::new(&s, NKV, HD, Some(&Device::Cpu));
                let (a, b) = (run(&mut host, &STEPS), run(&mut tensors, &STEPS));
                // candle's matmuls against the kernel's sums: rounding apart.
                let d = max_diff(&a, &b);
                assert!(d < 1e-5, "{p:?} {retention:?} offload {offload}: {d}");
                assert_eq!((host.len(), host.seen()), (tensors.len(), tensors.seen()));
            }
        }
    }
}

#[test]
fn rows_kept_as_tensors_save_the_host_stores_bytes() {
    for p in Precision::ALL {
        let mut host = layer(p, Retention::All);
        let mut tensors = Layer::new(&spec(p, Retention::All), NKV, HD, Some(&Device::Cpu));
        run(&mut host, &STEPS);
        run(&mut tensors, &STEPS);
        let (a, b) = (host.raw_state().unwrap(), tensors.raw_state().unwrap());
        // The same rows encoded by the CPU codec and by candle ops: the same bytes, so a
        // state saved on a GPU restores on the CPU and back.
        assert!(a.k == b.k && a.v == b.v, "{p:?}: stored rows differ");
        assert!(a.residual_k == b.residual_k && a.residual_v == b.residual_v);
        assert_eq!(a.residual_from, b.residual_from);
    }
}

#[test]
fn the_window_keeps_the_sinks_and_the_latest_positions() {
    let mut c = layer(
        Precision::F32,
        Retention::Window {
            window: 6,
            sinks: 2,
        },
    );
    run(&mut c, &[3, 1, 4, 2, 9, 1]);
    assert_eq!((c.seen(), c.len()), (20, 8));
    let held = |c: &Layer| {
        let (s, w) = c.held();
        s.chain(w).collect::<Vec<_>>()
    };
    assert_eq!(held(&c), [0, 1, 14, 15, 16, 17, 18, 19]);
    // What the slots hold is what those positions were given (keys rotated at their place).
    let rope = test_rope(4096, HD);
    let (k, v) = c.read_range(14, 20).unwrap();
    let (k_want, v_want) = kv(14, 6);
    let d = (v - v_want.squeeze(0).unwrap().unsqueeze(0).unwrap())
        .unwrap()
        .abs()
        .unwrap()
        .max_all()
        .unwrap()
        .to_scalar::<f32>()
        .unwrap();
    assert_eq!(d, 0.0);
    let k_rot = rope.apply(&k_want, 14).unwrap();
    let d = (k - k_rot).unwrap().abs().unwrap().max_all().unwrap();
    assert_eq!(d.to_scalar::<f32>().unwrap(), 0.0);
}

#[test]
fn once_positions_are_dropped_the_window_attends_as_streaming_llm_places_them() {
    // Sinks 0, 1 and the window 13..19, then position 19: in the cache's frame the sinks sit
    // at 0, 1, the window at 2..8 and the query at 8.
    let mut c = layer(
        Precision::F32,
        Retention::Window {
            window: 6,
            sinks: 2,
        },
    );
    run(&mut c, &[3, 1, 4, 2, 9]);
    let got = run(&mut c, &[1]).pop().unwrap();
    let rope = test_rope(4096, HD);
    let (ks, vs) = kv(0, 2);
    let (kw, vw) = kv(13, 7);
    let k = Tensor::cat(
        &[rope.apply(&ks, 0).unwrap(), rope.apply(&kw, 2).unwrap()],
        2,
    )
    .unwrap()
    .squeeze(0)
    .unwrap();
    let v = Tensor::cat(&[vs, vw], 2).unwrap().squeeze(0).unwrap();
    let q = Tensor::ones((1, NKV * 2, 1, HD), candle_core::DType::F32, &Device::Cpu).unwrap();
    let q = rope.apply(&q, 8).unwrap().reshape((NKV, 2, HD)).unwrap();
    let want = crate::model::kernels::attention::attend_candle_ops(&q, &k, &v, 1, 0.125)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap();
    for (g, w) in got.iter().zip(&want) {
        assert!(
            (f32::from_bits(*g) - w).abs() < 1e-4,
            "{} vs {w}",
            f32::from_bits(*g)
        );
    }
}

#[test]
fn truncating_inside_the_window_works_and_before_it_is_refused() {
    let mut c = layer(
        Precision::F16,
        Retention::Window {
            window: 6,
            sinks: 2,
        },
    );
    run(&mut c, &[4, 8]); // holds sinks 0,1 and 6..12
    c.truncate(9).unwrap();
    assert_eq!((c.seen(), c.len()), (9, 5));
    assert!(c.truncate(4).is_err(), "positions 2..6 were dropped");
    c.truncate(0).unwrap();
    assert_eq!((c.len(), c.seen()), (0, 0));
}

/// (A quantized cache cannot promise this: positions that had left its f16 residual before
/// the truncation are read from their quantized rows afterwards.)
#[test]
fn a_truncated_cache_continues_as_if_the_dropped_positions_never_came() {
    for p in [Precision::F16, Precision::Bf16, Precision::F32] {
        let mut a = layer(p, Retention::All);
        run(&mut a, &[30, 1, 1]);
        a.truncate(30).unwrap();
        let mut b = layer(p, Retention::All);
        run(&mut b, &[30]);
        assert!(run(&mut a, &[1, 3]) == run(&mut b, &[1, 3]), "{p:?}");
    }
}

#[test]
fn a_saved_and_restored_layer_continues_bit_for_bit_in_every_combination() {
    for p in Precision::ALL {
        for r in [
            Retention::All,
            Retention::Window {
                window: 20,
                sinks: 3,
            },
            Retention::Window {
                window: 9,
                sinks: 0,
            },
        ] {
            let mut a = layer(p, r);
            run(&mut a, &[25, 1, 1]);
            let st = a.raw_state().unwrap();
            let mut b = layer(p, r);
            b.restore_raw(a.seen(), &st).unwrap();
            assert_eq!(b.len(), a.len());
            assert_eq!(b.bytes_used(), a.bytes_used());
            assert!(
                run(&mut a, &[1, 4, 1]) == run(&mut b, &[1, 4, 1]),
                "{p:?} {r:?}"
            );
        }
    }
}

#[test]
fn a_damaged_state_is_refused_and_leaves_the_layer_empty() {
    let mut a = layer(Precision::F16, Retention::All);
    run(&mut a, &[10]);
    let mut st = a.raw_state().unwrap();
    st.k.iter_mut().for_each(|b| *b = 0xff); // f16 NaN
    let mut b = layer(Precision::F16, Retention::All);
    let e = b.restore_raw(10, &st).unwrap_err();
    assert!(e.to_string().contains("NaN"), "{e}");
    assert_eq!(b.seen(), 0);
    let st = a.raw_state().unwrap();
    assert!(b.restore_raw(11, &st).is_err(), "one position short");
}

#[test]
fn bytes_used_is_what_the_size_arithmetic_predicts() {
    use crate::kv::size::KvDims;
    let d = KvDims {
        layers: 1,
        kv_heads: NKV,
        head_dim: HD,
    };
    for p in Precision::ALL {
        for (r, steps) in [
            (Retention::All, &[40usize, 1][..]),
            (
                Retention::Window {
                    window: 16,
                    sinks: 4,
                },
                &[40, 1][..],
            ),
        ] {
            let mut c = layer(p, r);
            run(&mut c, steps);
            let mode = crate::kv::CacheMode {
                precision: p,
                retention: r,
                offload: false,
                residual: 8,
                budget_bytes: None,
            };
            assert_eq!(
                c.bytes_used() as f64,
                d.bytes_for_mode(&mode, c.seen()),
                "{p:?} {r:?}"
            );
        }
    }
}

#[test]
fn a_residual_larger_than_the_context_allocates_no_more_than_the_context() {
    let mut s = spec(Precision::Int8, Retention::All);
    (s.residual, s.max_positions) = (usize::MAX / 2, 64);
    let mut c = Layer::new(&s, NKV, HD, None);
    run(&mut c, &[10, 1]);
    // 256 main slots (the first allocation) and at most 64 f16 residual rows.
    assert!(
        c.bytes() <= 2 * NKV * (256 * 68 + 64 * 128),
        "{}",
        c.bytes()
    );
}

#[test]
fn quantized_attention_stays_close_to_f32() {
    let mut exact = layer(Precision::F32, Retention::All);
    let a = run(&mut exact, &[200, 1]);
    for (p, tol) in [(Precision::Int8, 0.02), (Precision::Int4, 0.2)] {
        let mut q = layer(p, Retention::All);
        let b = run(&mut q, &[200, 1]);
        let (x, y) = (&a[1], &b[1]);
        let worst = x
            .iter()
            .zip(y)
            .map(|(x, y)| (f32::from_bits(*x) - f32::from_bits(*y)).abs())
            .fold(0f32, f32::max);
        assert!(worst < tol, "{p:?}: {worst}");
    }
}

#[test]
fn a_declared_window_goes_back_over_a_wide_step_as_if_it_had_taken_single_steps() {
    // A model-declared window of 16 kept in a ring of 16 + 8 spare, past its first drops: a step
    // of 4 positions of which 3 are taken back (a rejected draft), then single steps, attend as
    // single steps all along do.
    let declared = |w| LayerSpec {
        attend_window: Some(16),
        ..spec(
            Precision::F32,
            Retention::Window {
                window: w,
                sinks: 0,
            },
        )
    };
    let rope = test_rope(4096, HD);
    let mut single = Layer::new(&declared(24), NKV, HD, None);
    let mut wide = Layer::new(&declared(24), NKV, HD, None);
    for p in 0..40 {
        step(&mut single, &rope, p, 1);
        step(&mut wide, &rope, p, 1);
    }
    let want: Vec<Vec<u32>> = (40..44).map(|p| step(&mut single, &rope, p, 1)).collect();
    step(&mut wide, &rope, 40, 4);
    wide.truncate(41).unwrap();
    let got: Vec<Vec<u32>> = (41..44).map(|p| step(&mut wide, &rope, p, 1)).collect();
    assert_eq!(got, want[1..]);
}

/// Whether a step of `t` positions, after `before` single steps, attends each of its rows as that
/// row's single step does, on a model-declared window of `attend` positions kept in a ring of
/// `ring`: the first row that does not, as (row, head, query).
fn wide_step_row_that_differs(
    attend: usize,
    ring: usize,
    before: usize,
    t: usize,
) -> Option<(usize, usize, usize)> {
    let declared = LayerSpec {
        attend_window: Some(attend),
        ..spec(
            Precision::F32,
            Retention::Window {
                window: ring,
                sinks: 0,
            },
        )
    };
    let rope = test_rope(4096, HD);
    let mut single = Layer::new(&declared, NKV, HD, None);
    let mut wide = Layer::new(&declared, NKV, HD, None);
    for p in 0..before {
        step(&mut single, &rope, p, 1);
        step(&mut wide, &rope, p, 1);
    }
    let want: Vec<Vec<u32>> = (before..before + t)
        .map(|p| step(&mut single, &rope, p, 1))
        .collect();
    let got = step(&mut wide, &rope, before, t);
    // Output rows [nkv, g·t, hd]: row (h, g, i) of the wide step is row (h, g) of step i.
    (0..t)
        .flat_map(|i| (0..NKV).flat_map(move |h| (0..2).map(move |g| (i, h, g))))
        .find(|&(i, h, g)| {
            got[((h * 2 + g) * t + i) * HD..][..HD] != want[i][(h * 2 + g) * HD..][..HD]
        })
}

#[test]
fn a_declared_windows_wide_step_attends_each_row_as_its_single_step_does() {
    assert_eq!(wide_step_row_that_differs(16, 24, 40, 4), None);
}

#[test]
fn a_declared_window_wider_than_a_key_chunk_attends_a_wide_steps_rows_as_single_steps() {
    assert_eq!(wide_step_row_that_differs(300, 364, 400, 4), None);
}

fn budget(budget: usize, evict: Evict) -> Retention {
    Retention::Budget {
        budget,
        sinks: 4,
        evict,
        pyramid: false,
    }
}

/// The positions head h holds, in slot order.
fn held_positions(c: &Layer, h: usize) -> Vec<u32> {
    c.budget.as_ref().expect("a budget layer").positions[h].clone()
}

#[test]
fn a_budget_is_the_full_cache_bit_for_bit_until_it_evicts() {
    for p in Precision::ALL {
        for evict in Evict::ALL {
            let mut full = layer(p, Retention::All);
            let mut b = layer(p, budget(100, evict));
            assert!(
                run(&mut full, &STEPS) == run(&mut b, &STEPS),
                "{p:?} {evict:?}"
            );
            assert_eq!((b.len(), b.seen(), b.evicted()), (65, 65, Some(0)));
        }
    }
}

#[test]
fn a_budget_holds_its_budget_after_a_prompt_and_at_most_slack_more_while_decoding() {
    for evict in Evict::ALL {
        let mut c = layer(Precision::F16, budget(80, evict));
        c.forward_begins(300).unwrap();
        run(&mut c, &[100, 100, 100]);
        assert_eq!((c.len(), c.seen()), (80, 300), "{evict:?} after the prompt");
        let row = Precision::F16.row_bytes(HD);
        assert_eq!(c.bytes_used(), 2 * NKV * 80 * row);
        for i in 0..100 {
            c.forward_begins(1).unwrap();
            run(&mut c, &[1]);
            assert!(
                (80..=80 + SLACK).contains(&c.len()),
                "{evict:?} step {i}: {}",
                c.len()
            );
        }
        assert_eq!(c.seen(), 400);
        assert_eq!(c.evicted(), Some(400 - c.len()));
    }
}

#[test]
fn a_budget_keeps_the_sinks_and_the_newest_positions_in_order() {
    for evict in Evict::ALL {
        let mut c = layer(Precision::Int8, budget(80, evict));
        c.forward_begins(300).unwrap();
        run(&mut c, &[300]);
        for h in 0..NKV {
            let ps = held_positions(&c, h);
            assert_eq!(ps.len(), 80);
            assert!(ps.windows(2).all(|w| w[0] < w[1]), "{evict:?} ascending");
            assert_eq!(&ps[..4], &[0, 1, 2, 3], "{evict:?} sinks");
            let newest: Vec<u32> = (300 - OBSERVE_WINDOW as u32..300).collect();
            assert_eq!(&ps[80 - OBSERVE_WINDOW..], &newest[..], "{evict:?} newest");
        }
    }
}

#[test]
fn a_prompt_evicts_only_once_its_last_step_is_attended() {
    let mut c = layer(Precision::F16, budget(80, Evict::SnapKv));
    c.forward_begins(300).unwrap();
    run(&mut c, &[100, 100]);
    assert_eq!((c.len(), c.evicted()), (200, Some(0)));
    run(&mut c, &[100]);
    assert_eq!((c.len(), c.evicted()), (80, Some(220)));
}

#[test]
fn an_evicted_budget_goes_back_to_positions_after_its_last_eviction_only() {
    let mut c = layer(Precision::F16, budget(80, Evict::Tova));
    c.forward_begins(300).unwrap();
    run(&mut c, &[300]);
    c.forward_begins(10).unwrap();
    run(&mut c, &[10]);
    let why = c.truncate_refusal(299).expect("refused");
    assert!(why.contains("evicted positions before 300"), "{why}");
    assert!(c.truncate(299).is_err());
    // From 300 on every position is held: going back there drops the last 10 slots.
    c.truncate(300).unwrap();
    assert_eq!((c.len(), c.seen()), (80, 300));
    assert_eq!(*held_positions(&c, 0).last().unwrap(), 299);
    // And a step from there attends as it did the first time.
    let mut again = layer(Precision::F16, budget(80, Evict::Tova));
    again.forward_begins(300).unwrap();
    run(&mut again, &[300]);
    assert!(run(&mut c, &[10]) == run(&mut again, &[10]));
}

#[test]
fn snapkv_keeps_the_best_scored_positions_and_their_neighbours_per_head() {
    let mut bg = Budgeted::new(2, 70, 4, 32, Evict::SnapKv);
    bg.hold_all(200);
    // Head 0 attends to position 100, head 1 to position 150; everything else a little.
    for (h, p) in [(0, 100), (1, 150)] {
        bg.scores[h].fill(0.001);
        bg.scores[h][p] = 1.0;
    }
    let keep = bg.choose(200);
    for (h, p) in [(0usize, 100usize), (1, 150)] {
        assert_eq!(keep[h].len(), 70);
        // Pooling keeps the 3 on either side along with the position itself.
        for q in p - 3..=p + 3 {
            assert!(keep[h].contains(&q), "head {h} keeps {q}");
        }
    }
    assert!(!keep[0].contains(&96) && !keep[1].contains(&100));
    assert_ne!(keep[0], keep[1], "heads choose apart");
}

#[test]
fn tova_makes_one_choice_for_every_head_from_their_summed_attention() {
    let mut bg = Budgeted::new(2, 70, 4, 32, Evict::Tova);
    bg.hold_all(200);
    bg.scores[0][100] = 1.0;
    bg.scores[1][150] = 1.0;
    let keep = bg.choose(200);
    assert_eq!(keep[0], keep[1]);
    assert!(keep[0].contains(&100) && keep[0].contains(&150));
    // No pooling: the neighbours of a chosen position are not kept for it.
    assert!(!keep[0].contains(&99));
}

#[test]
fn a_budget_kept_as_tensors_evicts_and_attends_as_the_cpu_kernel_does() {
    // The GPU's path run on the CPU (rows as tensors, or offloaded and staged; candle's softmax
    // gives the scores) against the CPU kernel's, through a prompt that evicts and a decode that
    // evicts again, for a float and a quantized precision and each policy.
    for p in [Precision::F16, Precision::Int8] {
        for evict in Evict::ALL {
            for offload in [false, true] {
                let s = LayerSpec {
                    offload,
                    ..spec(p, budget(80, evict))
                };
                let mut host = Layer::new(&s, NKV, HD, None);
                let mut tensors = Layer::new(&s, NKV, HD, Some(&Device::Cpu));
                let mut outs = (Vec::new(), Vec::new());
                // A prompt of 300 in three steps (evicting at its end), then 40 decode steps.
                let forwards = std::iter::once(vec![100, 100, 100]).chain((0..40).map(|_| vec![1]));
                for steps in forwards {
                    host.forward_begins(steps.iter().sum()).unwrap();
                    tensors.forward_begins(steps.iter().sum()).unwrap();
                    outs.0.extend(run(&mut host, &steps));
                    outs.1.extend(run(&mut tensors, &steps));
                }
                let d = max_diff(&outs.0, &outs.1);
                assert!(d < 1e-4, "{p:?} {evict:?} offload {offload}: {d}");
                assert_eq!(host.evicted(), tensors.evicted());
                assert!(host.evicted().unwrap() > 220, "{:?}", host.evicted());
                for h in 0..NKV {
                    assert_eq!(held_positions(&host, h), held_positions(&tensors, h));
                }
            }
        }
    }
}

#[test]
fn a_verification_taken_back_leaves_every_cache_as_single_steps_left_it() {
    // Drafting's rows apart (`undo.rs`): after a prompt, rounds of a verification — its first row
    // kept, its guesses appended one row at a time, the rejected ones with other rows — truncated
    // back to the guesses kept; against single steps over the kept positions, every kept row's
    // attention and every step after it agree bit for bit, through ring slots and residual slots
    // overwritten and put back, and a budget's evictions and deferred scores.
    let window = Retention::Window {
        window: 40,
        sinks: 4,
    };
    // (precision, retention, rows as tensors: the GPU's path and its stores' raw bytes, on the CPU)
    let cases = [
        (Precision::Int8, Retention::All, false),
        (Precision::Int4, window, false),
        (Precision::F16, window, false),
        (Precision::Int8, window, true),
        (Precision::F16, budget(48, Evict::SnapKv), false),
        (Precision::Int8, budget(48, Evict::Tova), false),
        (Precision::F32, budget(48, Evict::H2o), false),
    ];
    let rope = test_rope(4096, HD);
    for (p, r, tensors) in cases {
        let on = tensors.then_some(&Device::Cpu);
        let mut plain = Layer::new(&spec(p, r), NKV, HD, on);
        let mut drafted = Layer::new(&spec(p, r), NKV, HD, on);
        let mut outs = (Vec::new(), Vec::new());
        for c in [&mut plain, &mut drafted] {
            c.forward_begins(60).unwrap();
            step(c, &rope, 0, 60);
        }
        let mut pos = 60;
        let mut taken_back = 0;
        for round in 0..24 {
            let guesses = (3 + round % 7).min(drafted.draft_room());
            // Kept: the first row and `kept` guesses (all of them every fourth round).
            let kept = if round % 4 == 3 {
                guesses
            } else {
                round % (guesses + 1)
            };
            drafted.verify_begins().unwrap();
            let mut rows = Vec::new();
            for i in 0..=guesses {
                let salt = if i > kept { 0.9 } else { 0.0 };
                rows.push(step_salted(&mut drafted, &rope, pos + i, 1, salt));
            }
            drafted.truncate(pos + kept + 1).unwrap();
            taken_back += guesses - kept;
            outs.1.extend(rows.into_iter().take(kept + 1));
            for i in 0..=kept {
                plain.forward_begins(1).unwrap();
                outs.0.push(step(&mut plain, &rope, pos + i, 1));
            }
            pos += kept + 1;
            // A plain step after the verification.
            drafted.forward_begins(1).unwrap();
            outs.1.push(step(&mut drafted, &rope, pos, 1));
            plain.forward_begins(1).unwrap();
            outs.0.push(step(&mut plain, &rope, pos, 1));
            pos += 1;
        }
        assert!(taken_back > 40, "{p:?} {r:?}: {taken_back}");
        assert_eq!(outs.0.len(), outs.1.len());
        for (i, (a, b)) in outs.0.iter().zip(&outs.1).enumerate() {
            assert!(a == b, "{p:?} {r:?}: step {i} of {}", outs.0.len());
        }
        assert_eq!(
            plain.raw_state().ok().map(|s| s.k),
            drafted.raw_state().ok().map(|s| s.k)
        );
        if r != Retention::All {
            assert!(plain.len() < pos, "{p:?} {r:?}: nothing was dropped");
        }
        assert_eq!(plain.evicted(), drafted.evicted(), "{p:?} {r:?}");
    }
}

#[test]
fn going_back_before_a_verification_keeps_the_scores_of_the_guesses_it_kept() {
    // A verification keeps some guesses and the answer ends; then the conversation goes back
    // further (/undo): single steps would have scored those guesses before going back, and a
    // budget that later evicts chooses by those scores.
    let rope = test_rope(4096, HD);
    for evict in Evict::ALL {
        let r = budget(64, evict);
        let (mut plain, mut drafted) = (layer(Precision::F16, r), layer(Precision::F16, r));
        for c in [&mut plain, &mut drafted] {
            c.forward_begins(60).unwrap();
            step(c, &rope, 0, 60);
        }
        // The first row and 3 of 5 guesses kept.
        drafted.verify_begins().unwrap();
        for i in 0..6 {
            step_salted(
                &mut drafted,
                &rope,
                60 + i,
                1,
                if i > 3 { 0.9 } else { 0.0 },
            );
        }
        drafted.truncate(64).unwrap();
        for i in 0..4 {
            plain.forward_begins(1).unwrap();
            step(&mut plain, &rope, 60 + i, 1);
        }
        // Back to 62, then single steps far enough to evict twice.
        let mut outs = (Vec::new(), Vec::new());
        for (c, out) in [(&mut plain, &mut outs.0), (&mut drafted, &mut outs.1)] {
            c.truncate(62).unwrap();
            for pos in 62..140 {
                c.forward_begins(1).unwrap();
                out.push(step(c, &rope, pos, 1));
            }
        }
        assert!(outs.0 == outs.1, "{evict:?}");
        assert!(plain.evicted().unwrap() > 0);
        for h in 0..NKV {
            assert_eq!(
                held_positions(&plain, h),
                held_positions(&drafted, h),
                "{evict:?}"
            );
        }
    }
}

#[test]
fn a_store_grows_by_doubling_from_256_or_by_its_step_and_never_past_its_limit() {
    assert_eq!(grown_capacity(1, 4096, None), 256);
    assert_eq!(grown_capacity(257, 4096, None), 512);
    assert_eq!(grown_capacity(600, 640, None), 640);
    assert_eq!(grown_capacity(1, 4096, Some(64)), 64);
    assert_eq!(grown_capacity(65, 4096, Some(64)), 128);
    assert_eq!(grown_capacity(128, 4096, Some(64)), 128);
    assert_eq!(grown_capacity(600, 610, Some(64)), 610);
}

#[test]
fn a_layer_growing_by_a_step_holds_its_positions_as_one_that_doubles() {
    // The same positions written in the steps of `STEPS` into a layer growing 16 positions at a
    // time and into one doubling from 256: the same rows in both, and the first never holds
    // more than 15 positions beyond those written.
    let by_16 = LayerSpec {
        grow_by: Some(16),
        ..spec(Precision::F16, Retention::All)
    };
    let mut a = Layer::new(&by_16, NKV, HD, None);
    let mut b = Layer::new(&spec(Precision::F16, Retention::All), NKV, HD, None);
    let row = 2 * NKV * Precision::F16.row_bytes(HD);
    let (ra, rb) = (run(&mut a, &STEPS), run(&mut b, &STEPS));
    assert_eq!(ra, rb);
    let written = a.len();
    assert!(a.bytes() >= written * row && a.bytes() < (written + 16) * row);
}

#[test]
fn a_restored_window_wider_than_the_context_allocates_what_writing_it_did() {
    // A window of 1,004 positions in a context of 300: writing 260 positions grows the store to
    // the context (300), not to the next doubling (512); restoring them must allocate the same.
    let wide = LayerSpec {
        max_positions: 300,
        ..spec(
            Precision::F16,
            Retention::Window {
                window: 1000,
                sinks: 4,
            },
        )
    };
    let mut a = Layer::new(&wide, NKV, HD, None);
    run(&mut a, &[200, 60]);
    let row = 2 * NKV * Precision::F16.row_bytes(HD);
    assert_eq!(a.bytes(), 300 * row);
    let mut b = Layer::new(&wide, NKV, HD, None);
    b.restore_raw(a.seen(), &a.raw_state().unwrap()).unwrap();
    assert_eq!(b.bytes(), a.bytes());
    assert!(run(&mut a, &[1, 1]) == run(&mut b, &[1, 1]));
}

#[test]
fn a_paged_layer_attends_as_a_contiguous_one_in_every_precision_and_retention() {
    // Pages of 16 positions (`paged.rs`): the steps of `STEPS` and then some, so that runs cross
    // pages, a window's ring wraps inside one and a budget evicts across them.
    let steps = [STEPS.as_slice(), &[30, 1, 1, 64, 1]].concat();
    let window = Retention::Window {
        window: 61,
        sinks: 4,
    };
    for p in Precision::ALL {
        for r in [Retention::All, window, budget(48, Evict::ALL[0])] {
            let paged = LayerSpec {
                grow_by: Some(16),
                ..spec(p, r)
            };
            let mut a = Layer::new(&paged, NKV, HD, None);
            let mut b = layer(p, r);
            assert!(run(&mut a, &steps) == run(&mut b, &steps), "{p:?} {r:?}");
            if a.budget.is_some() {
                // (An evicting budget is not saved: what it holds is its positions.)
                assert!(a.evicted().unwrap() > 0);
                for h in 0..NKV {
                    assert_eq!(held_positions(&a, h), held_positions(&b, h), "{p:?}");
                }
            } else {
                let (sa, sb) = (a.raw_state().unwrap(), b.raw_state().unwrap());
                assert!(sa.k == sb.k && sa.v == sb.v, "{p:?} {r:?}");
            }
        }
    }
}

#[test]
fn a_pyramid_budget_on_a_hybrid_model_allocates_what_the_size_arithmetic_counts() {
    use crate::kv::{size::KvDims, CacheSpec};
    // 24 blocks, every 4th attending: 6 KV layers with budgets 1.5 N down to 0.5 N.
    let cfg = crate::kv::test_hybrid_config(24, 4, NKV, HD);
    let prompt = 400;
    let spec = CacheSpec::full(Precision::F16, prompt).with(|m| {
        m.retention = Retention::Budget {
            budget: 200,
            sinks: 4,
            evict: Evict::SnapKv,
            pyramid: true,
        }
    });
    let mut cache = spec.build(&cfg, None);
    for l in cache.layers_mut() {
        l.forward_begins(prompt).unwrap();
        run(l, &[100; 4]);
    }
    let row = Precision::F16.row_bytes(HD);
    assert_eq!(cache.bytes_used(), 2 * NKV * row * 6 * 200);
    assert_eq!(
        cache.bytes_used() as f64,
        KvDims::bytes_for_spec(&spec, &cfg, prompt)
    );
    // No more than a server reserves for it (its states included).
    assert!(cache.bytes() as f64 <= KvDims::bytes_at_most(&spec, &cfg, prompt, 100));
}
