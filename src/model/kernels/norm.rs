//! RMSNorm over the last dimension, a prompt's rows split over candle's pool. candle-nn's CPU
//! `rms_norm` splits them with rayon: a second pool beside candle's, whose workers spin between
//! matmuls, so a 2-core prefill ran three busy threads on two cores. The values are candle's bit
//! for bit: each row computes the same operations in the same order.

use super::disjoint::for_each_row;
use anyhow::Result;
use candle_core::{CpuStorage, Storage, Tensor};

/// Elements below which one thread does the whole tensor (a decode step's row).
const PARALLEL_FROM: usize = 1 << 14;
/// Rows per work item.
const ROWS_PER_ITEM: usize = 4;

/// One row: `out = x / sqrt(mean(x²) + eps) · w`, as candle-nn's `rms_norm` computes it.
pub fn row(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let sum2 = x.iter().map(|&v| v * v).sum::<f32>();
    let m = (sum2 / x.len() as f32 + eps).sqrt();
    for ((o, &v), &a) in out.iter_mut().zip(x).zip(w) {
        *o = v / m * a;
    }
}

/// RMSNorm of `x [.., n]` with weights `w [n]`. Contiguous f32 CPU tensors take the pool; any
/// other goes through candle-nn's op (made contiguous first, as that op requires).
pub fn rms_norm(x: &Tensor, w: &Tensor, eps: f32) -> Result<Tensor> {
    let fallback = || -> Result<Tensor> { Ok(candle_nn::ops::rms_norm(&x.contiguous()?, w, eps)?) };
    let n = x.dim(candle_core::D::Minus1)?;
    if w.dims1()? != n || !x.device().is_cpu() {
        return fallback();
    }
    let (xs, xl) = x.storage_and_layout();
    let (ws, wl) = w.storage_and_layout();
    let (Storage::Cpu(CpuStorage::F32(xv)), Storage::Cpu(CpuStorage::F32(wv))) = (&*xs, &*ws)
    else {
        drop((xs, ws));
        return fallback();
    };
    let (Some((x0, x1)), Some((w0, w1))) = (xl.contiguous_offsets(), wl.contiguous_offsets())
    else {
        drop((xs, ws));
        return fallback();
    };
    let (xv, wv) = (&xv[x0..x1], &wv[w0..w1]);
    let mut out = vec![0f32; xv.len()];
    for_each_row(&mut out, n, ROWS_PER_ITEM, PARALLEL_FROM, |r, o| {
        row(&xv[r * n..(r + 1) * n], wv, eps, o)
    });
    let (shape, device) = (x.shape().clone(), x.device().clone());
    drop((xs, ws));
    Ok(Tensor::from_vec(out, shape, &device)?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    fn values(t: &Tensor) -> Vec<f32> {
        t.flatten_all().unwrap().to_vec1().unwrap()
    }

    #[test]
    fn rows_on_the_pool_give_candles_rms_norm_bit_for_bit() {
        for (t, n) in [(1, 576), (3, 64), (512, 576), (70, 2048)] {
            let x = Tensor::randn(0f32, 3.0, (1, t, n), &Device::Cpu).unwrap();
            let w = Tensor::randn(1f32, 0.5, n, &Device::Cpu).unwrap();
            let ours = rms_norm(&x, &w, 1e-5).unwrap();
            assert_eq!(ours.dims(), &[1, t, n]);
            let candle = candle_nn::ops::rms_norm(&x, &w, 1e-5).unwrap();
            assert_eq!(values(&ours), values(&candle), "t = {t}, n = {n}");
        }
    }

    #[test]
    fn a_contiguous_view_from_an_offset_is_normed_in_place() {
        // Rows 2..5 of 8: contiguous, starting 2 rows into the storage.
        let x = Tensor::randn(0f32, 1.0, (1, 8, 2048), &Device::Cpu).unwrap();
        let rows = x.narrow(1, 2, 3).unwrap();
        assert!(rows.is_contiguous());
        let w = Tensor::randn(1f32, 0.5, 2048, &Device::Cpu).unwrap();
        let ours = rms_norm(&rows, &w, 1e-5).unwrap();
        let want = candle_nn::ops::rms_norm(&rows.contiguous().unwrap(), &w, 1e-5).unwrap();
        assert_eq!(values(&ours), values(&want));
    }

    #[test]
    fn a_view_that_is_not_contiguous_goes_through_candle() {
        let x = Tensor::randn(0f32, 1.0, (1, 8, 128), &Device::Cpu).unwrap();
        let half = x.narrow(2, 0, 64).unwrap(); // rows of 64 with a stride of 128
        let w = Tensor::ones(64, candle_core::DType::F32, &Device::Cpu).unwrap();
        let ours = rms_norm(&half, &w, 1e-6).unwrap();
        let want = candle_nn::ops::rms_norm(&half.contiguous().unwrap(), &w, 1e-6).unwrap();
        assert_eq!(values(&ours), values(&want));
    }

    #[test]
    fn a_weight_of_the_wrong_length_is_an_error() {
        let x = Tensor::zeros((1, 2, 8), candle_core::DType::F32, &Device::Cpu).unwrap();
        let w = Tensor::ones(7, candle_core::DType::F32, &Device::Cpu).unwrap();
        assert!(rms_norm(&x, &w, 1e-6).is_err());
    }
}
