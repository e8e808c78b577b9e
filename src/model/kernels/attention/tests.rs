use super::*;
use crate::model::cache::{HostRows, Part, QueryRotation};
use candle_core::{DType, Device};

#[test]
fn fast_exp_is_within_4_ulp_of_libm_on_nonpositive_inputs() {
    for i in 0..200_000 {
        let x = -(i as f32) * 0.0005; // 0 .. -100
        let (a, b) = (exp_nonpositive(x), x.exp());
        if b < f32::MIN_POSITIVE * 1e6 {
            assert!(a < 1e-30, "x={x}: {a}");
            continue;
        }
        assert!(
            ((a - b) / b).abs() < 4.0 * f32::EPSILON,
            "x={x}: {a} vs {b}"
        );
    }
}

fn max_diff(a: &Tensor, b: &Tensor) -> f32 {
    (a - b)
        .unwrap()
        .abs()
        .unwrap()
        .flatten_all()
        .unwrap()
        .max(0)
        .unwrap()
        .to_scalar()
        .unwrap()
}

/// Keys and values `[nkv, L, hd]` encoded row by row in format C: (k rows, v rows, decoded k, decoded v).
#[allow(clippy::type_complexity)]
fn encoded<C: Codec>(k: &Tensor, v: &Tensor) -> (Vec<C::E>, Vec<C::E>, Tensor, Tensor) {
    let (nkv, l, hd) = k.dims3().unwrap();
    let enc = |x: &Tensor| {
        let xs: Vec<f32> = x.flatten_all().unwrap().to_vec1().unwrap();
        let mut rows = vec![C::E::default(); nkv * l * C::row_len(hd)];
        let mut dec = vec![0f32; nkv * l * hd];
        for (i, (x, r)) in xs
            .chunks_exact(hd)
            .zip(rows.chunks_exact_mut(C::row_len(hd)))
            .enumerate()
        {
            C::encode(x, r);
            let mut buf = vec![0f32; hd];
            dec[i * hd..(i + 1) * hd].copy_from_slice(C::decode_scalar(r, &mut buf));
        }
        let dec = Tensor::from_vec(dec, (nkv, l, hd), &Device::Cpu).unwrap();
        (rows, dec)
    };
    let ((kr, kd), (vr, vd)) = (enc(k), enc(v));
    (kr, vr, kd, vd)
}

/// A view of positions `0..L` of rows `[nkv, L, row_len]`, cut into parts at `cuts`.
fn view_of<'a, E>(
    k: &'a [E],
    v: &'a [E],
    l: usize,
    row_len: usize,
    cuts: &[usize],
    wrap: fn(HostRows<'a, E>) -> Rows<'a>,
) -> KvView<'a> {
    let mut bounds = vec![0];
    bounds.extend(cuts.iter().copied().filter(|&c| c > 0 && c < l));
    bounds.push(l);
    let parts = bounds
        .windows(2)
        .map(|w| Part {
            rows: wrap(HostRows {
                k: &k[w[0] * row_len..],
                v: &v[w[0] * row_len..],
                head_stride: l * row_len,
                row_len,
                len: w[1] - w[0],
            }),
            query: QueryRotation::AtPosition,
        })
        .collect();
    KvView {
        parts,
        hadamard: None,
        window: None,
        first: 0,
    }
}

/// Keys and values `[nkv, L, hd]` as one part of device rows (the device path's view).
fn dense_view(k: &Tensor, v: &Tensor, window: Option<usize>) -> KvView<'static> {
    KvView {
        parts: vec![Part {
            rows: Rows::Dense {
                k: k.unsqueeze(0).unwrap(),
                v: v.unsqueeze(0).unwrap(),
            },
            query: QueryRotation::AtPosition,
        }],
        hadamard: None,
        window,
        first: 0,
    }
}

fn rand(shape: (usize, usize, usize)) -> Tensor {
    Tensor::randn(0f32, 1.0, shape, &Device::Cpu).unwrap()
}

#[test]
fn fused_kernel_equals_candle_ops_for_prefill_and_decode_however_the_view_is_cut() {
    let (nkv, g, hd) = (3, 3, 64);
    // Short caches, and long ones whose keys span several softmax chunks (CHUNK = 256).
    for (t, l) in [
        (1, 1),
        (1, 17),
        (5, 5),
        (7, 30),
        (4, 33),
        (1, 257),
        (1, 700),
        (9, 600),
    ] {
        let (k, v, q) = (
            rand((nkv, l, hd)),
            rand((nkv, l, hd)),
            rand((nkv, g * t, hd)),
        );
        let (kr, vr, _, _) = encoded::<kvrows::F32>(&k, &v);
        let reference = attend_candle_ops(&q, &k, &v, t, 0.125).unwrap();
        let whole = view_of(&kr, &vr, l, hd, &[], Rows::F32);
        let fused = attend_view(&[&q], &whole, t, 0.125).unwrap();
        assert!(max_diff(&fused, &reference) < 1e-5, "t={t} L={l}");
        let cut = view_of(&kr, &vr, l, hd, &[1, l / 3, l / 2 + 1, l - 1], Rows::F32);
        let parts = attend_view(&[&q], &cut, t, 0.125).unwrap();
        assert_eq!(
            max_diff(&parts, &fused),
            0.0,
            "t={t} L={l}: parts change bits"
        );
    }
}

#[test]
fn a_declared_window_limits_each_query_to_its_last_w_positions() {
    let (nkv, g, hd) = (1, 2, 64);
    for (t, l, w) in [(1, 40, 7), (5, 40, 7), (9, 600, 300), (3, 10, 16)] {
        let (k, v, q) = (
            rand((nkv, l, hd)),
            rand((nkv, l, hd)),
            rand((nkv, g * t, hd)),
        );
        let (kr, vr, _, _) = encoded::<kvrows::F32>(&k, &v);
        let mut view = view_of(&kr, &vr, l, hd, &[l / 2], Rows::F32);
        view.window = Some(w);
        let fused = attend_view(&[&q], &view, t, 0.125).unwrap();
        // Reference: each row alone over exactly its last w keys, with candle ops.
        for r in 0..t {
            let own = l - t + r;
            let from = (own + 1).saturating_sub(w);
            let (k, v) = (
                k.narrow(1, from, own + 1 - from).unwrap(),
                v.narrow(1, from, own + 1 - from).unwrap(),
            );
            for gi in 0..g {
                let qr = q.narrow(1, gi * t + r, 1).unwrap();
                let want = attend_candle_ops(&qr, &k, &v, 1, 0.125).unwrap();
                let got = fused.narrow(1, gi * t + r, 1).unwrap();
                assert!(max_diff(&got, &want) < 1e-5, "t={t} L={l} w={w} row {r}");
            }
        }
        // The device path (candle ops with the mask) agrees.
        let dense = dense_view(&k, &v, Some(w));
        let masked = attend_view(&[&q.to_dtype(DType::F32).unwrap()], &dense, t, 0.125);
        assert!(
            max_diff(&masked.unwrap(), &fused) < 1e-5,
            "device path t={t}"
        );
    }
}

/// A tensor's values as bits (so ±0 and NaN compare exactly).
fn bits(t: &Tensor) -> Vec<u32> {
    let v: Vec<f32> = t.flatten_all().unwrap().to_vec1().unwrap();
    v.into_iter().map(f32::to_bits).collect()
}

#[test]
fn the_simd_build_of_the_tile_loops_gives_the_portable_builds_bits() {
    // Prefill and decode shapes, a view cut in parts, a window, head dims 64, 256 and 60 (not
    // a multiple of 8), rows of the tile from two heads when t is not a multiple of 8, f16
    // and int8 rows.
    for (nkv, g, hd, t, l, w) in [
        (2, 3, 64, 13, 300, None),
        (1, 4, 256, 1, 700, None),
        (1, 4, 256, 9, 40, Some(7)),
        (3, 1, 64, 1, 1, None),
        (2, 3, 60, 11, 30, Some(9)),
        // Decode tiles of 1–4 rows: head dims with and without a tail, a window.
        (2, 3, 60, 1, 300, None),
        (1, 2, 72, 1, 50, Some(20)),
        (4, 1, 64, 1, 17, None),
        (1, 4, 128, 1, 15, None),
        (3, 2, 64, 2, 33, Some(5)),
    ] {
        let (k, v, q) = (
            rand((nkv, l, hd)),
            rand((nkv, l, hd)),
            rand((nkv, g * t, hd)),
        );
        let (kr, vr, _, _) = encoded::<kvrows::F16>(&k, &v);
        let mut view = view_of(&kr, &vr, l, hd, &[l / 3], Rows::F16);
        view.window = w;
        // The SIMD build's output and the portable one's, over `view`.
        let both = |view: &KvView<'_>| {
            let run = |portable| attend_host_at(&[&q], view, t, 0.125, None, 0, portable);
            (run(false).unwrap().0, run(true).unwrap().0)
        };
        let (simd, portable) = both(&view);
        assert_eq!(bits(&simd), bits(&portable), "f16 t={t} L={l} hd={hd}");
        if hd % kvrows::QK != 0 {
            continue;
        }
        let (kr, vr, _, _) = encoded::<kvrows::Q8>(&k, &v);
        let view = view_of(&kr, &vr, l, kvrows::Q8::row_len(hd), &[], Rows::Int8);
        let (simd, portable) = both(&view);
        assert_eq!(bits(&simd), bits(&portable), "int8 t={t} L={l} hd={hd}");
    }
}

#[test]
fn a_later_positions_infinite_value_never_reaches_an_earlier_row() {
    // f16 rows store |v| > 65504 as ∞. Rows 0..8 of a prefill share a tile; key 5's value is
    // ∞, which rows 0-4 must not see: each must equal itself computed alone (a decode).
    let (nkv, g, hd, t) = (1, 1, 64, 8);
    let (k, q) = (rand((nkv, t, hd)), rand((nkv, g * t, hd)));
    let mut vs: Vec<f32> = rand((nkv, t, hd)).flatten_all().unwrap().to_vec1().unwrap();
    vs[5 * hd + 3] = 1e6;
    let v = Tensor::from_vec(vs, (nkv, t, hd), &Device::Cpu).unwrap();
    let (kr, vr, _, _) = encoded::<kvrows::F16>(&k, &v);
    let all = attend_view(&[&q], &view_of(&kr, &vr, t, hd, &[], Rows::F16), t, 0.125).unwrap();
    for r in 0..5 {
        let n = (r + 1) * hd;
        let alone = view_of(&kr[..n], &vr[..n], r + 1, hd, &[], Rows::F16);
        let one = attend_view(&[&q.narrow(1, r, 1).unwrap()], &alone, 1, 0.125).unwrap();
        let row = all.narrow(1, r, 1).unwrap();
        assert!(
            bits(&row).iter().all(|&b| f32::from_bits(b).is_finite()),
            "row {r}"
        );
        assert_eq!(bits(&row), bits(&one), "row {r}");
    }
}

/// A format's rows as a view part.
trait Wrap: Codec {
    fn wrap(x: HostRows<'_, Self::E>) -> Rows<'_>;
}
impl Wrap for kvrows::F16 {
    fn wrap(x: HostRows<'_, half::f16>) -> Rows<'_> {
        Rows::F16(x)
    }
}
impl Wrap for kvrows::Bf16 {
    fn wrap(x: HostRows<'_, half::bf16>) -> Rows<'_> {
        Rows::Bf16(x)
    }
}
impl Wrap for kvrows::Q8 {
    fn wrap(x: HostRows<'_, u8>) -> Rows<'_> {
        Rows::Int8(x)
    }
}
impl Wrap for kvrows::Q4 {
    fn wrap(x: HostRows<'_, u8>) -> Rows<'_> {
        Rows::Int4(x)
    }
}

/// Attention over rows stored in format C gives the bits of attention over their decoded values.
fn stored_rows_read_in_place<C: Wrap>() {
    let (nkv, g, hd) = (2, 3, 64);
    for (t, l) in [(1, 1), (1, 300), (5, 40), (3, 600)] {
        let (k, v, q) = (
            rand((nkv, l, hd)),
            rand((nkv, l, hd)),
            rand((nkv, g * t, hd)),
        );
        let (kr, vr, kd, vd) = encoded::<C>(&k, &v);
        let (kf, vf, _, _) = encoded::<kvrows::F32>(&kd, &vd);
        let rl = C::row_len(hd);
        let stored = attend_view(
            &[&q],
            &view_of(&kr, &vr, l, rl, &[l / 2], C::wrap),
            t,
            0.125,
        );
        let widened = attend_view(&[&q], &view_of(&kf, &vf, l, hd, &[], Rows::F32), t, 0.125);
        assert_eq!(
            max_diff(&stored.unwrap(), &widened.unwrap()),
            0.0,
            "t={t} L={l}"
        );
    }
}

#[test]
fn f16_bf16_int8_and_int4_rows_give_the_bits_of_their_values_widened_to_f32() {
    stored_rows_read_in_place::<kvrows::F16>();
    stored_rows_read_in_place::<kvrows::Bf16>();
    stored_rows_read_in_place::<kvrows::Q8>();
    stored_rows_read_in_place::<kvrows::Q4>();
}

#[test]
fn the_hadamard_product_of_other_devices_equals_the_fast_transform_to_rounding() {
    for (hd, b) in [(64, 64), (128, 128), (96, 32)] {
        let x = Tensor::randn(0f32, 3.0, (2, 3, 5, hd), &Device::Cpu).unwrap();
        let fast = hadamard_rows(&x, b).unwrap();
        let product = hadamard_product(&x, b).unwrap();
        assert!(max_diff(&fast, &product) < 1e-5, "hd {hd}, block {b}");
        // The rotation is its own inverse.
        let back = hadamard_product(&product, b).unwrap();
        assert!(max_diff(&back, &x) < 1e-5, "hd {hd}, block {b}: H·H ≠ I");
    }
}

#[test]
fn hadamard_rotated_rows_give_the_attention_of_the_plain_rows() {
    let (nkv, g, hd, t, l) = (2, 2, 64, 3, 90);
    let (k, v, q) = (
        rand((nkv, l, hd)),
        rand((nkv, l, hd)),
        rand((nkv, g * t, hd)),
    );
    let rotate = |x: &Tensor| {
        let mut xs: Vec<f32> = x.flatten_all().unwrap().to_vec1().unwrap();
        kvrows::hadamard(&mut xs, 64);
        Tensor::from_vec(xs, x.dims(), &Device::Cpu).unwrap()
    };
    let (kr, vr, _, _) = encoded::<kvrows::F32>(&rotate(&k), &rotate(&v));
    let mut view = view_of(&kr, &vr, l, hd, &[], Rows::F32);
    view.hadamard = Some(64);
    let rotated = attend_view(&[&q], &view, t, 0.125).unwrap();
    let plain = attend_candle_ops(&q, &k, &v, t, 0.125).unwrap();
    assert!(max_diff(&rotated, &plain) < 1e-5);
}

#[test]
fn a_part_pairs_its_keys_with_the_query_rotation_it_names() {
    let (nkv, g, hd, t, l) = (2, 2, 64, 2, 20);
    let (k, v) = (rand((nkv, l, hd)), rand((nkv, l, hd)));
    let (q0, q1) = (rand((nkv, g * t, hd)), rand((nkv, g * t, hd)));
    let (kr, vr, _, _) = encoded::<kvrows::F32>(&k, &v);
    let mut view = view_of(&kr, &vr, l, hd, &[4], Rows::F32);
    view.parts[0].query = QueryRotation::ForSinks; // the first 4 positions pair with q1
    let got = attend_view(&[&q0, &q1], &view, t, 0.125).unwrap();
    let s0 = q1.matmul(&k.narrow(1, 0, 4).unwrap().t().unwrap()).unwrap();
    let s1 = q0
        .matmul(&k.narrow(1, 4, l - 4).unwrap().t().unwrap())
        .unwrap();
    let scores = Tensor::cat(&[s0, s1], 2).unwrap();
    let want = softmax_weighted(scores, &v, t, 0.125, None).unwrap();
    assert!(max_diff(&got, &want) < 1e-5);
    assert!(attend_view(&[&q0], &view, t, 0.125).is_err(), "q1 missing");
}

#[test]
fn a_query_row_gives_the_same_bits_in_a_prefill_as_alone() {
    for t in [6, 700] {
        let (nkv, g, hd) = (2, 2, 64);
        let (k, v) = (rand((nkv, t, hd)), rand((nkv, t, hd)));
        let q = Tensor::randn(0f32, 1.0, (nkv, g, t, hd), &Device::Cpu).unwrap();
        let (kr, vr, _, _) = encoded::<kvrows::F16>(&k, &v);
        let view = view_of(&kr, &vr, t, hd, &[], Rows::F16);
        let all = attend_view(&[&q.reshape((nkv, g * t, hd)).unwrap()], &view, t, 0.125);
        // The last query alone, as a decode step would see it.
        let last = q
            .narrow(2, t - 1, 1)
            .unwrap()
            .reshape((nkv, g, hd))
            .unwrap();
        let one = attend_view(&[&last], &view, 1, 0.125).unwrap();
        let all_last = all
            .unwrap()
            .reshape((nkv, g, t, hd))
            .unwrap()
            .narrow(2, t - 1, 1)
            .unwrap()
            .reshape((nkv, g, hd))
            .unwrap();
        assert_eq!(max_diff(&all_last, &one), 0.0);
    }
    let _ = DType::F32;
}

#[test]
fn a_query_row_gives_the_same_bits_in_a_prefill_as_alone_under_a_window() {
    // A window's lower edge masks keys at the start of a row's range as the diagonal does at
    // its end; t = 700 spans three key chunks, so whole-chunk, edge and diagonal spans occur.
    let (nkv, g, hd, t, w) = (2, 3, 64, 700, 300);
    let (k, v) = (rand((nkv, t, hd)), rand((nkv, t, hd)));
    let q = Tensor::randn(0f32, 1.0, (nkv, g, t, hd), &Device::Cpu).unwrap();
    let (kr, vr, _, _) = encoded::<kvrows::F16>(&k, &v);
    let mut view = view_of(&kr, &vr, t, hd, &[], Rows::F16);
    view.window = Some(w);
    let all = attend_view(&[&q.reshape((nkv, g * t, hd)).unwrap()], &view, t, 0.125)
        .unwrap()
        .reshape((nkv, g, t, hd))
        .unwrap();
    // Each of the last rows alone, as a decode step at that position would see it.
    for pos in [t - 1, t - 150, w - 1, w] {
        let mut prefix = view_of(&kr, &vr, pos + 1, hd, &[], Rows::F16);
        // The rows' head stride stays the full cache's: the prefix view reads its first
        // pos + 1 positions.
        for p in &mut prefix.parts {
            if let Rows::F16(x) = &mut p.rows {
                x.head_stride = t * hd;
            }
        }
        prefix.window = Some(w);
        let one_q = q.narrow(2, pos, 1).unwrap().reshape((nkv, g, hd)).unwrap();
        let one = attend_view(&[&one_q], &prefix, 1, 0.125).unwrap();
        let want = all
            .narrow(2, pos, 1)
            .unwrap()
            .reshape((nkv, g, hd))
            .unwrap();
        assert_eq!(max_diff(&want, &one), 0.0, "position {pos}");
    }
}

#[test]
fn observed_weights_are_the_softmax_weights_of_the_last_queries_summed_per_kv_head() {
    // Several key chunks, grouped heads, a cut view, a declared window; observe 1, some or all rows.
    for (nkv, g, t, l, w, observe) in [
        (2, 3, 1, 700, None, 1),
        (2, 2, 9, 600, None, 4),
        (1, 3, 6, 300, Some(40), 6),
        (3, 1, 5, 5, None, 2),
    ] {
        let hd = 32;
        let (k, v, q) = (
            rand((nkv, l, hd)),
            rand((nkv, l, hd)),
            rand((nkv, g * t, hd)),
        );
        let (kr, vr, kd, vd) = encoded::<kvrows::F32>(&k, &v);
        let mut view = view_of(&kr, &vr, l, hd, &[l / 2], Rows::F32);
        view.window = w;
        let (out, got) = attend_host_at(&[&q], &view, t, 0.125, None, observe, false).unwrap();
        // The reference: candle's softmax over the masked scores, rows summed.
        let scores = q.matmul(&kd.t().unwrap()).unwrap();
        let probs = softmax_probs(scores, t, 0.125, w, None).unwrap(); // [nkv, g*t, L]
        let want: Vec<f32> = probs
            .reshape((nkv, g, t, l))
            .unwrap()
            .narrow(2, t - observe, observe)
            .unwrap()
            .sum((1, 2))
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        assert_eq!(got.len(), nkv * l);
        for (i, (a, b)) in got.iter().zip(&want).enumerate() {
            assert!((a - b).abs() < 1e-5, "t={t} L={l} key {i}: {a} vs {b}");
        }
        // Each observed row's weights sum to 1: g · observe per KV head.
        for h in 0..nkv {
            let total: f32 = got[h * l..(h + 1) * l].iter().sum();
            assert!(
                (total - (g * observe) as f32).abs() < 1e-3,
                "head {h}: {total}"
            );
        }
        // Observing changes no output bit, and the device path reports the same weights.
        let plain = attend_host_at(&[&q], &view, t, 0.125, None, 0, false)
            .unwrap()
            .0;
        assert_eq!(bits(&out), bits(&plain));
        let dense = dense_view(&kd, &vd, w);
        let (_, dev) = attend_view_observed(&[&q], &dense, t, 0.125, None, observe).unwrap();
        for (a, b) in dev.iter().zip(&want) {
            assert!((a - b).abs() < 1e-5, "device path t={t}");
        }
    }
}

#[test]
fn key_chunks_sit_at_absolute_positions_so_a_row_has_its_bits_wherever_its_view_starts() {
    // Positions 100..700 of a sequence, a declared window of 300: the step's rows against the
    // whole view, and each row alone against a view that starts at its window's first key.
    let (nkv, g, hd, w, first, l, t) = (1, 2, 64, 300, 100, 600, 8);
    let (k, v, q) = (
        rand((nkv, l, hd)),
        rand((nkv, l, hd)),
        rand((nkv, g * t, hd)),
    );
    let (kr, vr, kd, vd) = encoded::<kvrows::F16>(&k, &v);
    let rows_from = |a: usize, len: usize| Part {
        rows: Rows::F16(HostRows {
            k: &kr[a * hd..],
            v: &vr[a * hd..],
            head_stride: l * hd,
            row_len: hd,
            len,
        }),
        query: QueryRotation::AtPosition,
    };
    let whole = KvView {
        parts: vec![rows_from(0, l)],
        hadamard: None,
        window: Some(w),
        first,
    };
    let all = attend_host_at(&[&q], &whole, t, 0.125, None, 0, false)
        .unwrap()
        .0;
    // Against candle's ops over the same keys.
    let qs: Vec<f32> = q.flatten_all().unwrap().to_vec1().unwrap();
    let scores = q.matmul(&kd.t().unwrap()).unwrap();
    let want = softmax_weighted(scores, &vd, t, 0.125, Some(w)).unwrap();
    assert!(max_diff(&all, &want) < 1e-5);
    for r in 0..t {
        let own = l - t + r;
        let start = own + 1 - w;
        let alone = KvView {
            parts: vec![rows_from(start, own + 1 - start)],
            hadamard: None,
            window: Some(w),
            first: first + start,
        };
        for gi in 0..g {
            let row = &qs[(gi * t + r) * hd..][..hd];
            let q1 = Tensor::from_vec(row.to_vec(), (nkv, 1, hd), &Device::Cpu).unwrap();
            let one = attend_host_at(&[&q1], &alone, 1, 0.125, None, 0, false)
                .unwrap()
                .0;
            let got = all.narrow(1, gi * t + r, 1).unwrap();
            assert_eq!(bits(&one), bits(&got), "row {r} head {gi}");
        }
    }
}

/// A sink logit per query head joins the softmax with no value: each row's output is the plain
/// attention times Σe^x / (Σe^x + e^sink) — computed here from the scores themselves — in the
/// fused kernel (over several key chunks, prefill and decode rows) and in the device path.
#[test]
fn sink_logits_scale_each_heads_attention_by_the_weight_the_sink_leaves_it() {
    let (nkv, g, hd) = (2, 3, 64);
    let sinks: Vec<f32> = vec![-30.0, 0.0, 1.5, 3.0, -1.0, 40.0];
    for (t, l) in [(1, 300), (4, 40), (1, 9)] {
        let (k, v, q) = (
            rand((nkv, l, hd)),
            rand((nkv, l, hd)),
            rand((nkv, g * t, hd)),
        );
        let (kr, vr, _, _) = encoded::<kvrows::F32>(&k, &v);
        let view = view_of(&kr, &vr, l, hd, &[l / 2], Rows::F32);
        let plain = attend_view(&[&q], &view, t, 0.125).unwrap();
        let (fused, _) = attend_view_observed(&[&q], &view, t, 0.125, Some(&sinks), 0).unwrap();
        let scores: Vec<f32> = (q.matmul(&k.t().unwrap()).unwrap() * 0.125)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap(); // [nkv, g*t, L]
        let (plain_v, fused_v): (Vec<f32>, Vec<f32>) = (
            plain.flatten_all().unwrap().to_vec1().unwrap(),
            fused.flatten_all().unwrap().to_vec1().unwrap(),
        );
        for row in 0..nkv * g * t {
            let (h, r) = (row / (g * t), row % (g * t));
            let sink = sinks[h * g + r / t] as f64;
            // Row r sees keys 0..=L − t + (r mod t).
            let seen = l - t + r % t + 1;
            let xs = &scores[row * l..][..seen];
            let m = xs.iter().fold(sink, |m, &x| m.max(x as f64));
            let s: f64 = xs.iter().map(|&x| (x as f64 - m).exp()).sum();
            let keep = s / (s + (sink - m).exp());
            for e in 0..hd {
                let (p, f) = (plain_v[row * hd + e] as f64, fused_v[row * hd + e] as f64);
                assert!(
                    (f - p * keep).abs() < 1e-5 * (1.0 + p.abs()),
                    "t={t} L={l} row {row}: {f} vs {p}·{keep}"
                );
            }
        }
        let dense = dense_view(&k, &v, None);
        let (device, _) = attend_view_observed(&[&q], &dense, t, 0.125, Some(&sinks), 0).unwrap();
        assert!(max_diff(&device, &fused) < 1e-5, "device path t={t} L={l}");
    }
}

#[test]
fn a_sink_count_other_than_the_query_heads_is_refused() {
    let (k, v, q) = (rand((1, 4, 64)), rand((1, 4, 64)), rand((1, 2, 64)));
    let (kr, vr, _, _) = encoded::<kvrows::F32>(&k, &v);
    let view = view_of(&kr, &vr, 4, 64, &[], Rows::F32);
    let err = attend_view_observed(&[&q], &view, 1, 0.125, Some(&[0.0]), 0).unwrap_err();
    assert!(
        err.to_string().contains("1 sink logits for 2 query heads"),
        "{err}"
    );
}

/// Sequences of a batched step attend in one call of the kernel, each over its own view: every
/// sequence gets the bits and the observed weights it gets alone, whether the call's items are
/// whole tiles (every view within one key chunk) or (tile, chunk) pairs (a view over several).
#[test]
fn sequences_attending_in_one_call_get_the_bits_each_gets_alone() {
    let (nkv, g, hd) = (2, 3, 64);
    let sinks: Vec<f32> = vec![-1.0, 0.5, 2.0, 0.0, -3.0, 1.0];
    for lens in [vec![9, 40, 200, 1], vec![700, 5, 300]] {
        let data: Vec<_> = lens
            .iter()
            .map(|&l| {
                let (k, v, q) = (rand((nkv, l, hd)), rand((nkv, l, hd)), rand((nkv, g, hd)));
                let (kr, vr, _, _) = encoded::<kvrows::F16>(&k, &v);
                (kr, vr, q, l)
            })
            .collect();
        let views: Vec<KvView> = data
            .iter()
            .map(|(kr, vr, _, l)| view_of(kr, vr, *l, hd, &[l / 2], Rows::F16))
            .collect();
        let qs: Vec<[&Tensor; 1]> = data.iter().map(|(_, _, q, _)| [q]).collect();
        for sinks in [None, Some(&sinks[..])] {
            let seqs: Vec<SeqQuery> = views
                .iter()
                .zip(&qs)
                .enumerate()
                .map(|(i, (view, qs))| SeqQuery {
                    qs,
                    view,
                    observe: i % 2,
                })
                .collect();
            let together = attend_views_observed(&seqs, 1, 0.125, sinks).unwrap();
            for (s, (out, weights)) in seqs.iter().zip(&together) {
                let (alone, alone_w) =
                    attend_view_observed(s.qs, s.view, 1, 0.125, sinks, s.observe).unwrap();
                assert_eq!(bits(out), bits(&alone), "lengths {lens:?}");
                assert_eq!(weights, &alone_w, "lengths {lens:?}");
                assert_eq!(
                    weights.len(),
                    s.observe * nkv * s.view.parts.iter().map(|p| p.rows.len()).sum::<usize>()
                );
            }
        }
    }
}
