//! The device path: attention with candle ops (a causal mask, a softmax, two matmuls), and the
//! Hadamard rotation of rows that a rotated cache stores.

use super::super::kvrows::{self};
use anyhow::{ensure, Result};
use candle_core::Tensor;

/// `x` `[..., hd]` with each block of `b` values multiplied by the orthonormal Hadamard matrix of
/// size `b`: the rotation of quantized KV rows. On the CPU, the fast transform
/// (`kvrows::hadamard`); on another device, a matrix product there ([`hadamard_product`]), equal
/// to it to rounding.
pub fn hadamard_rows(x: &Tensor, b: usize) -> Result<Tensor> {
    if !x.device().is_cpu() {
        return hadamard_product(x, b);
    }
    ensure!(
        x.dims().last().is_some_and(|hd| hd % b == 0),
        "Hadamard block {b} does not divide the rows of {:?}",
        x.dims()
    );
    let mut xs: Vec<f32> = x
        .to_dtype(candle_core::DType::F32)?
        .flatten_all()?
        .to_vec1()?;
    kvrows::hadamard(&mut xs, b);
    Ok(Tensor::from_vec(xs, x.dims(), x.device())?.to_dtype(x.dtype())?)
}

/// [`hadamard_rows`] as a matrix product on `x`'s device. The matrix is made once per thread,
/// size and device.
pub fn hadamard_product(x: &Tensor, b: usize) -> Result<Tensor> {
    use candle_core::DeviceLocation;
    use std::cell::RefCell;
    thread_local! {
        static MATRICES: RefCell<Vec<(usize, DeviceLocation, Tensor)>> = const { RefCell::new(Vec::new()) };
    }
    let dims = x.dims().to_vec();
    ensure!(
        dims.last().is_some_and(|hd| hd % b == 0),
        "Hadamard block {b} does not divide the rows of {dims:?}"
    );
    let at = x.device().location();
    let h = MATRICES.with(|m| -> Result<Tensor> {
        let mut m = m.borrow_mut();
        if let Some((_, _, h)) = m.iter().find(|(n, l, _)| *n == b && *l == at) {
            return Ok(h.clone());
        }
        // Row i of H is H applied to the unit vector e_i (H is symmetric).
        let mut xs = vec![0f32; b * b];
        for (i, row) in xs.chunks_exact_mut(b).enumerate() {
            row[i] = 1.0;
            kvrows::hadamard(row, b);
        }
        let h = Tensor::from_vec(xs, (b, b), x.device())?;
        m.push((b, at, h.clone()));
        Ok(h)
    })?;
    let n = x.elem_count() / b;
    let h = h.to_dtype(x.dtype())?;
    let x = x.contiguous()?.reshape((n, b))?; // [rows · hd / b, b]
    Ok(x.matmul(&h)?.reshape(dims)?)
}

/// `k`, `v`: `[nkv, L, hd]` tensors, attended with candle ops (the reference for the fused kernel).
pub fn attend_candle_ops(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    t: usize,
    scale: f32,
) -> Result<Tensor> {
    let scores = q.matmul(&k.t()?)?; // [nkv, g*t, L]
    softmax_weighted(scores, &v.contiguous()?, t, scale, None)
}

/// softmax(scale · scores + causal mask) · v, scores `[nkv, g*t, L]`, v `[nkv, L, hd]`; with a
/// `window`, each query also sees no key more than `window - 1` positions before it.
pub(super) fn softmax_weighted(
    scores: Tensor,
    v: &Tensor,
    t: usize,
    scale: f32,
    window: Option<usize>,
) -> Result<Tensor> {
    Ok(softmax_probs(scores, t, scale, window, None)?.matmul(v)?)
}

/// softmax(scale · scores + causal mask), scores `[nkv, g*t, L]`: the weights of
/// [`softmax_weighted`].
pub(super) fn softmax_probs(
    scores: Tensor,
    t: usize,
    scale: f32,
    window: Option<usize>,
    sinks: Option<&[f32]>,
) -> Result<Tensor> {
    let (nkv, gt, kv_len) = scores.dims3()?;
    let scores = (scores * scale as f64)?;
    let scores = if t > 1 || window.is_some_and(|w| w < kv_len) {
        let mask = causal_mask(t, kv_len, window, scores.device())?; // [t, L]
        scores
            .reshape((nkv, gt / t, t, kv_len))?
            .broadcast_add(&mask)?
            .reshape((nkv, gt, kv_len))?
    } else {
        scores
    };
    let Some(sinks) = sinks else {
        return Ok(candle_nn::ops::softmax_last_dim(&scores)?);
    };
    // Each row's sink logit as one more column, dropped after the softmax.
    let g = gt / t;
    let col: Vec<f32> = (0..nkv * gt)
        .map(|r| sinks[(r / gt) * g + (r % gt) / t])
        .collect();
    let col = Tensor::from_vec(col, (nkv, gt, 1), scores.device())?.to_dtype(scores.dtype())?;
    let probs = candle_nn::ops::softmax_last_dim(&Tensor::cat(&[&scores, &col], 2)?)?;
    // Made contiguous: CUDA's matmul refuses rows strided by kv_len + 1 (found on the first GPU
    // run: "matmul is only supported for contiguous tensors"); the CPU's takes them.
    Ok(probs.narrow(2, 0, kv_len)?.contiguous()?)
}

/// `[t, L]`: 0 where query i (at position L - t + i) may see key j, -inf where j is in its future
/// (or, with a `window`, `window` or more positions in its past).
pub fn causal_mask(
    t: usize,
    kv_len: usize,
    window: Option<usize>,
    device: &candle_core::Device,
) -> Result<Tensor> {
    let offset = kv_len - t;
    let mask: Vec<f32> = (0..t)
        .flat_map(|i| {
            let start = window.map_or(0, |w| (offset + i + 1).saturating_sub(w));
            (0..kv_len).map(move |j| {
                if j <= offset + i && j >= start {
                    0.0
                } else {
                    f32::NEG_INFINITY
                }
            })
        })
        .collect();
    Ok(Tensor::from_vec(mask, (t, kv_len), device)?)
}
