//! The precision axis: where a layer's rows live, slot by slot, in one format. A slot holds one
//! position of every KV head; which position goes in which slot is the retention axis's business
//! (`layer.rs`), not the store's.
//!
//! Layout, per store: keys and values each `[n_kv_heads, capacity, row]`, a row being `head_dim`
//! values in the precision's format (`model::kernels::kvrows`). [`HostStore`] keeps them in host
//! memory and hands attention borrowed rows; [`DeviceStore`] keeps float rows, and
//! [`QDeviceStore`] INT8/INT4 rows (`qrows`), as tensors on a device (CUDA, Metal, or the CPU
//! running the GPU's path).

use super::qrows::{self, QRows};
use crate::model::cache::{
    with_codec, HostRows, OnDevice, Part, Precision, QueryRotation, RowFormat, Rows,
};
use crate::model::kernels::kvrows::{self, Codec};
use anyhow::{bail, Result};
use candle_core::{DType, Device, Tensor};

/// A layer's rows in one precision.
pub trait RowStore: Send + Sync {
    fn precision(&self) -> Precision;
    /// Slots allocated.
    fn capacity(&self) -> usize;
    /// Makes room for `cap` slots, keeping what slots `0..keep` hold.
    fn grow(&mut self, cap: usize, keep: usize) -> Result<()>;
    /// Encodes keys and values `[1, n_kv_heads, t, head_dim]` (f32, keys rotated) into slots
    /// `slot..slot + t`.
    fn write(&mut self, slot: usize, k: &Tensor, v: &Tensor) -> Result<()>;
    /// Slots `slot..slot + len` as a part of a view.
    fn part(&self, slot: usize, len: usize, query: QueryRotation) -> Result<Part<'_>>;
    /// Slots `slot..slot + len` decoded to f32, `[1, n_kv_heads, len, head_dim]` each, on the CPU.
    fn read(&self, slot: usize, len: usize) -> Result<(Tensor, Tensor)>;
    /// The stored bytes of slots `slot..slot + len`, `[n_kv_heads, len, row bytes]` each (saving).
    fn raw(&self, slot: usize, len: usize) -> Result<(Vec<u8>, Vec<u8>)>;
    /// Puts bytes from [`RowStore::raw`] back into slots `slot..slot + len`.
    fn write_raw(&mut self, slot: usize, len: usize, k: &[u8], v: &[u8]) -> Result<()>;
    /// Bytes allocated.
    fn bytes(&self) -> usize;
    /// Keeps, for each head h, the rows of slots `keep[h]` (ascending; as many for every head) in
    /// slots `0..keep[h].len()`, in that order: a cache that evicts by score compacting what it
    /// keeps. Other slots' contents are left unspecified. A store that can then holds `cap`
    /// slots (at least those kept), giving back what an evicted prompt took.
    fn retain(&mut self, keep: &[Vec<usize>], _cap: usize) -> Result<()> {
        retain_by_copy(self, keep)
    }

    /// How many slots from `slot` on one [`RowStore::part`] can cover (a paged store's page
    /// ends; unbounded for a contiguous one).
    fn contiguous(&self, _slot: usize) -> usize {
        usize::MAX
    }
}

/// [`RowStore::retain`] by reading the stored bytes and writing back those kept.
pub(crate) fn retain_by_copy<S: RowStore + ?Sized>(
    store: &mut S,
    keep: &[Vec<usize>],
) -> Result<()> {
    let Some(n) = keep.iter().flatten().max().map(|m| m + 1) else {
        return Ok(());
    };
    let len = keep[0].len();
    let (k, v) = store.raw(0, n)?;
    let row = k.len() / (keep.len() * n);
    let pick = |bytes: &[u8]| -> Vec<u8> {
        let mut out = Vec::with_capacity(keep.len() * len * row);
        for (h, slots) in keep.iter().enumerate() {
            for &s in slots {
                out.extend_from_slice(&bytes[(h * n + s) * row..][..row]);
            }
        }
        out
    };
    store.write_raw(0, len, &pick(&k), &pick(&v))
}

/// Slots `slot..slot + len` of `store` (rows of `nkv` heads × `hd`) as `[1, nkv, len, hd]`
/// tensors on `device`, for offloaded rows: only the stored bytes cross (float rows keep their
/// dtype; quantized rows are decoded to f32 on `device`), and quantized rows stay
/// Hadamard-rotated.
pub fn stage(
    store: &dyn RowStore,
    (nkv, hd): (usize, usize),
    slot: usize,
    len: usize,
    device: &Device,
) -> Result<(Tensor, Tensor)> {
    let (k, v) = store.raw(slot, len)?;
    let p = store.precision();
    let shape = (1, nkv, len, hd);
    let put = |bytes: &[u8]| -> Result<Tensor> {
        Ok(match p.on_device() {
            OnDevice::Float(_) => with_codec!(p, |C| {
                let xs: Vec<<C as Codec>::E> = bytemuck::pod_collect_to_vec(bytes);
                Tensor::from_vec(xs, shape, device)?
            }),
            OnDevice::Quantized(_) => {
                let r = qrows::from_host(bytes, p, (nkv, len, hd), device)?;
                qrows::decode(&r, p)?
            }
        })
    };
    Ok((put(&k)?, put(&v)?))
}

/// The store for `precision`: in host memory (`on_device` None), or as tensors on a device.
pub fn new_store(
    precision: Precision,
    n_kv_heads: usize,
    head_dim: usize,
    on_device: Option<&Device>,
) -> Box<dyn RowStore> {
    if let Some(dev) = on_device {
        return match precision.on_device() {
            OnDevice::Float(dtype) => Box::new(DeviceStore::new(
                precision,
                dtype,
                n_kv_heads,
                head_dim,
                dev.clone(),
            )),
            OnDevice::Quantized(_) => Box::new(QDeviceStore::new(
                precision,
                n_kv_heads,
                head_dim,
                dev.clone(),
            )),
        };
    }
    with_codec!(precision, |C| Box::new(HostStore::<C>::new(
        n_kv_heads, head_dim
    )))
}

/// Rows in host memory, `[n_kv_heads, capacity, row_len]` elements of `C::E` for keys and values.
pub struct HostStore<C: RowFormat> {
    nkv: usize,
    hd: usize,
    row: usize,
    cap: usize,
    k: Vec<C::E>,
    v: Vec<C::E>,
}

impl<C: RowFormat> HostStore<C> {
    pub fn new(nkv: usize, hd: usize) -> Self {
        Self {
            nkv,
            hd,
            row: C::row_len(hd),
            cap: 0,
            k: Vec::new(),
            v: Vec::new(),
        }
    }

    fn check(&self, slot: usize, len: usize) -> Result<()> {
        if slot.checked_add(len).is_none_or(|e| e > self.cap) {
            bail!(
                "KV slots {slot}..{} are outside the {} allocated",
                slot.saturating_add(len),
                self.cap
            );
        }
        Ok(())
    }

    /// Index of the first element of (head, slot).
    fn at(&self, h: usize, slot: usize) -> usize {
        (h * self.cap + slot) * self.row
    }
}

impl<C: RowFormat> RowStore for HostStore<C> {
    fn precision(&self) -> Precision {
        C::PRECISION
    }

    fn retain(&mut self, keep: &[Vec<usize>], cap: usize) -> Result<()> {
        if keep.len() != self.nkv || keep.iter().any(|s| s.len() != keep[0].len()) {
            bail!("retaining KV rows: one slot list of equal length per head is needed");
        }
        if keep.iter().any(|s| s.windows(2).any(|w| w[0] >= w[1])) {
            bail!("retaining KV rows: the slots kept must ascend");
        }
        for slots in keep {
            if let Some(&last) = slots.last() {
                self.check(last, 1)?;
            }
        }
        let cap = cap.max(keep[0].len());
        let n = self.nkv * cap * self.row;
        let (mut k, mut v) = (vec![C::E::default(); n], vec![C::E::default(); n]);
        for (h, slots) in keep.iter().enumerate() {
            for (i, &s) in slots.iter().enumerate() {
                let (from, to) = (self.at(h, s), (h * cap + i) * self.row);
                k[to..to + self.row].copy_from_slice(&self.k[from..from + self.row]);
                v[to..to + self.row].copy_from_slice(&self.v[from..from + self.row]);
            }
        }
        (self.k, self.v, self.cap) = (k, v, cap);
        Ok(())
    }

    fn capacity(&self) -> usize {
        self.cap
    }

    fn grow(&mut self, cap: usize, keep: usize) -> Result<()> {
        if cap <= self.cap {
            return Ok(());
        }
        let keep = keep.min(self.cap);
        let n = self.nkv * cap * self.row;
        let (mut k, mut v) = (vec![C::E::default(); n], vec![C::E::default(); n]);
        for h in 0..self.nkv {
            let (src, dst) = (self.at(h, 0), h * cap * self.row);
            let len = keep * self.row;
            k[dst..dst + len].copy_from_slice(&self.k[src..src + len]);
            v[dst..dst + len].copy_from_slice(&self.v[src..src + len]);
        }
        (self.k, self.v, self.cap) = (k, v, cap);
        Ok(())
    }

    fn write(&mut self, slot: usize, k: &Tensor, v: &Tensor) -> Result<()> {
        let t = k.dim(2)?;
        self.check(slot, t)?;
        if let Some(why) = C::PRECISION.unfit(self.hd) {
            return Err(crate::fixable(crate::Fix::KvType, why));
        }
        if C::PRECISION.quantized() && !k.device().is_cpu() {
            // Offloaded rows from a GPU: quantized there, only their bytes come to host memory.
            let p = C::PRECISION;
            let kb = qrows::to_host(&qrows::encode(k, p)?, p)?;
            let vb = qrows::to_host(&qrows::encode(v, p)?, p)?;
            return self.write_raw(slot, t, &kb, &vb);
        }
        for (src, dst) in [(k, 0), (v, 1)] {
            let xs: Vec<f32> = src
                .to_device(&Device::Cpu)?
                .to_dtype(DType::F32)?
                .flatten_all()?
                .to_vec1()?;
            if xs.len() != self.nkv * t * self.hd {
                bail!("KV rows of shape {:?} do not fit this cache", src.dims());
            }
            for h in 0..self.nkv {
                for i in 0..t {
                    let at = self.at(h, slot + i);
                    let out = if dst == 0 { &mut self.k } else { &mut self.v };
                    C::encode(
                        &xs[(h * t + i) * self.hd..][..self.hd],
                        &mut out[at..at + self.row],
                    );
                }
            }
        }
        Ok(())
    }

    fn part(&self, slot: usize, len: usize, query: QueryRotation) -> Result<Part<'_>> {
        self.check(slot, len)?;
        let start = self.at(0, slot);
        Ok(Part {
            rows: C::rows(HostRows {
                k: &self.k[start..],
                v: &self.v[start..],
                head_stride: self.cap * self.row,
                row_len: self.row,
                len,
            }),
            query,
        })
    }

    fn read(&self, slot: usize, len: usize) -> Result<(Tensor, Tensor)> {
        self.check(slot, len)?;
        let mut buf = vec![0f32; self.hd];
        let mut out = |src: &[C::E]| -> Result<Tensor> {
            let mut xs = Vec::with_capacity(self.nkv * len * self.hd);
            for h in 0..self.nkv {
                for i in 0..len {
                    let at = self.at(h, slot + i);
                    xs.extend_from_slice(C::decode_scalar(&src[at..at + self.row], &mut buf));
                }
            }
            Ok(Tensor::from_vec(
                xs,
                (1, self.nkv, len, self.hd),
                &Device::Cpu,
            )?)
        };
        Ok((out(&self.k)?, out(&self.v)?))
    }

    fn raw(&self, slot: usize, len: usize) -> Result<(Vec<u8>, Vec<u8>)> {
        self.check(slot, len)?;
        let bytes = |src: &[C::E]| {
            let mut out = Vec::with_capacity(self.nkv * len * self.row * size_of::<C::E>());
            for h in 0..self.nkv {
                let at = self.at(h, slot);
                out.extend_from_slice(bytemuck::cast_slice(&src[at..at + len * self.row]));
            }
            out
        };
        Ok((bytes(&self.k), bytes(&self.v)))
    }

    fn write_raw(&mut self, slot: usize, len: usize, k: &[u8], v: &[u8]) -> Result<()> {
        self.check(slot, len)?;
        let per_head = len * self.row * size_of::<C::E>();
        if k.len() != self.nkv * per_head || v.len() != k.len() {
            bail!(
                "saved rows of {} bytes do not fit {len} positions of this cache",
                k.len()
            );
        }
        for h in 0..self.nkv {
            let at = self.at(h, slot);
            for (src, dst) in [(k, &mut self.k), (v, &mut self.v)] {
                let rows: &mut [C::E] = &mut dst[at..at + len * self.row];
                bytemuck::cast_slice_mut::<C::E, u8>(rows)
                    .copy_from_slice(&src[h * per_head..(h + 1) * per_head]);
            }
        }
        Ok(())
    }

    fn bytes(&self) -> usize {
        2 * self.nkv * self.cap * self.row * size_of::<C::E>()
    }
}

/// Float rows as tensors on a CUDA/Metal device, `[1, n_kv_heads, capacity, head_dim]` each.
pub struct DeviceStore {
    precision: Precision,
    dtype: DType,
    nkv: usize,
    hd: usize,
    cap: usize,
    device: Device,
    buffers: Option<(Tensor, Tensor)>,
}

impl DeviceStore {
    /// Rows of `precision` kept as `dtype` tensors (the precision's [`OnDevice::Float`]).
    pub fn new(precision: Precision, dtype: DType, nkv: usize, hd: usize, device: Device) -> Self {
        Self {
            precision,
            dtype,
            nkv,
            hd,
            cap: 0,
            device,
            buffers: None,
        }
    }

    fn dtype(&self) -> DType {
        self.dtype
    }

    fn buffers(&self, slot: usize, len: usize) -> Result<(&Tensor, &Tensor)> {
        match &self.buffers {
            Some((k, v)) if slot + len <= self.cap => Ok((k, v)),
            _ => bail!(
                "KV slots {slot}..{} are outside the {} allocated",
                slot + len,
                self.cap
            ),
        }
    }
}

impl RowStore for DeviceStore {
    fn precision(&self) -> Precision {
        self.precision
    }

    fn capacity(&self) -> usize {
        self.cap
    }

    fn grow(&mut self, cap: usize, keep: usize) -> Result<()> {
        if cap <= self.cap {
            return Ok(());
        }
        let shape = (1, self.nkv, cap, self.hd);
        let k = Tensor::zeros(shape, self.dtype(), &self.device)?;
        let v = Tensor::zeros(shape, self.dtype(), &self.device)?;
        let keep = keep.min(self.cap);
        if let (Some((ok, ov)), true) = (&self.buffers, keep > 0) {
            k.slice_set(&ok.narrow(2, 0, keep)?.contiguous()?, 2, 0)?;
            v.slice_set(&ov.narrow(2, 0, keep)?.contiguous()?, 2, 0)?;
        }
        (self.buffers, self.cap) = (Some((k, v)), cap);
        Ok(())
    }

    fn write(&mut self, slot: usize, k: &Tensor, v: &Tensor) -> Result<()> {
        let (kb, vb) = self.buffers(slot, k.dim(2)?)?;
        let dt = self.dtype();
        let dev = &self.device;
        kb.slice_set(&k.to_device(dev)?.to_dtype(dt)?.contiguous()?, 2, slot)?;
        vb.slice_set(&v.to_device(dev)?.to_dtype(dt)?.contiguous()?, 2, slot)?;
        Ok(())
    }

    fn part(&self, slot: usize, len: usize, query: QueryRotation) -> Result<Part<'_>> {
        let (k, v) = self.buffers(slot, len)?;
        Ok(Part {
            rows: Rows::Dense {
                k: k.narrow(2, slot, len)?,
                v: v.narrow(2, slot, len)?,
            },
            query,
        })
    }

    fn read(&self, slot: usize, len: usize) -> Result<(Tensor, Tensor)> {
        let (k, v) = self.buffers(slot, len)?;
        let get = |x: &Tensor| -> Result<Tensor> {
            Ok(x.narrow(2, slot, len)?
                .to_dtype(DType::F32)?
                .to_device(&Device::Cpu)?
                .contiguous()?)
        };
        Ok((get(k)?, get(v)?))
    }

    fn raw(&self, slot: usize, len: usize) -> Result<(Vec<u8>, Vec<u8>)> {
        // Saved as a host store of the same precision saves them (widening and narrowing back a
        // float row is exact).
        let (k, v) = self.read(slot, len)?;
        let mut host = new_store(self.precision, self.nkv, self.hd, None);
        host.grow(len, 0)?;
        host.write(0, &k, &v)?;
        host.raw(0, len)
    }

    fn write_raw(&mut self, slot: usize, len: usize, k: &[u8], v: &[u8]) -> Result<()> {
        let mut host = new_store(self.precision, self.nkv, self.hd, None);
        host.grow(len, 0)?;
        host.write_raw(0, len, k, v)?;
        let (k, v) = host.read(0, len)?;
        self.write(slot, &k, &v)
    }

    fn bytes(&self) -> usize {
        2 * self.nkv * self.cap * self.hd * self.dtype().size_in_bytes()
    }
}

/// INT8/INT4 rows as tensors on a device (`qrows`), keys and values each: quants
/// `[1, n_kv_heads, capacity, hd or hd / 2]` u8 and scales `[1, n_kv_heads, capacity, hd / QK]`
/// f16. Written rows are quantized on the device; attention gets them decoded there.
pub struct QDeviceStore {
    precision: Precision,
    nkv: usize,
    hd: usize,
    cap: usize,
    device: Device,
    rows: Option<(QRows, QRows)>,
}

impl QDeviceStore {
    pub fn new(precision: Precision, nkv: usize, hd: usize, device: Device) -> Self {
        Self {
            precision,
            nkv,
            hd,
            cap: 0,
            device,
            rows: None,
        }
    }

    fn rows(&self, slot: usize, len: usize) -> Result<(&QRows, &QRows)> {
        match &self.rows {
            Some((k, v)) if slot.checked_add(len).is_some_and(|e| e <= self.cap) => Ok((k, v)),
            _ => bail!(
                "KV slots {slot}..{} are outside the {} allocated",
                slot.saturating_add(len),
                self.cap
            ),
        }
    }

    /// Slots `slot..slot + len` of `r`.
    fn narrow(r: &QRows, slot: usize, len: usize) -> Result<QRows> {
        Ok(QRows {
            q: r.q.narrow(2, slot, len)?,
            d: r.d.narrow(2, slot, len)?,
        })
    }

    /// Puts `src` into `dst` at `slot`.
    fn set(dst: &QRows, src: &QRows, slot: usize) -> Result<()> {
        dst.q.slice_set(&src.q.contiguous()?, 2, slot)?;
        dst.d.slice_set(&src.d.contiguous()?, 2, slot)?;
        Ok(())
    }

    fn put(&mut self, slot: usize, k: &QRows, v: &QRows) -> Result<()> {
        let (kb, vb) = self.rows(slot, k.q.dim(2)?)?;
        Self::set(kb, k, slot)?;
        Self::set(vb, v, slot)
    }
}

impl RowStore for QDeviceStore {
    fn precision(&self) -> Precision {
        self.precision
    }

    fn capacity(&self) -> usize {
        self.cap
    }

    fn grow(&mut self, cap: usize, keep: usize) -> Result<()> {
        if cap <= self.cap {
            return Ok(());
        }
        if let Some(why) = self.precision.unfit(self.hd) {
            return Err(crate::fixable(crate::Fix::KvType, why));
        }
        let qb = qrows::quant_bytes(self.precision, self.hd)?;
        let g = self.hd / kvrows::QK;
        let fresh = || -> Result<QRows> {
            Ok(QRows {
                q: Tensor::zeros((1, self.nkv, cap, qb), DType::U8, &self.device)?,
                d: Tensor::zeros((1, self.nkv, cap, g), DType::F16, &self.device)?,
            })
        };
        let (k, v) = (fresh()?, fresh()?);
        let keep = keep.min(self.cap);
        if let (Some((ok, ov)), true) = (&self.rows, keep > 0) {
            Self::set(&k, &Self::narrow(ok, 0, keep)?, 0)?;
            Self::set(&v, &Self::narrow(ov, 0, keep)?, 0)?;
        }
        (self.rows, self.cap) = (Some((k, v)), cap);
        Ok(())
    }

    fn write(&mut self, slot: usize, k: &Tensor, v: &Tensor) -> Result<()> {
        self.rows(slot, k.dim(2)?)?;
        let p = self.precision;
        let k = qrows::encode(&k.to_device(&self.device)?, p)?;
        let v = qrows::encode(&v.to_device(&self.device)?, p)?;
        self.put(slot, &k, &v)
    }

    fn part(&self, slot: usize, len: usize, query: QueryRotation) -> Result<Part<'_>> {
        let (k, v) = self.rows(slot, len)?;
        let p = self.precision;
        Ok(Part {
            rows: Rows::Dense {
                k: qrows::decode(&Self::narrow(k, slot, len)?, p)?,
                v: qrows::decode(&Self::narrow(v, slot, len)?, p)?,
            },
            query,
        })
    }

    fn read(&self, slot: usize, len: usize) -> Result<(Tensor, Tensor)> {
        let (k, v) = self.rows(slot, len)?;
        let p = self.precision;
        let get = |r: &QRows| -> Result<Tensor> {
            Ok(qrows::decode(&Self::narrow(r, slot, len)?, p)?.to_device(&Device::Cpu)?)
        };
        Ok((get(k)?, get(v)?))
    }

    fn raw(&self, slot: usize, len: usize) -> Result<(Vec<u8>, Vec<u8>)> {
        let (k, v) = self.rows(slot, len)?;
        let p = self.precision;
        Ok((
            qrows::to_host(&Self::narrow(k, slot, len)?, p)?,
            qrows::to_host(&Self::narrow(v, slot, len)?, p)?,
        ))
    }

    fn write_raw(&mut self, slot: usize, len: usize, k: &[u8], v: &[u8]) -> Result<()> {
        self.rows(slot, len)?;
        let (p, shape) = (self.precision, (self.nkv, len, self.hd));
        let k = qrows::from_host(k, p, shape, &self.device)?;
        let v = qrows::from_host(v, p, shape, &self.device)?;
        self.put(slot, &k, &v)
    }

    fn bytes(&self) -> usize {
        2 * self.nkv * self.cap * self.precision.row_bytes(self.hd)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every row of the precision table (`model::cache`) reaches every piece: a name that parses
    /// back, host and device stores that keep the codec's bytes, staging from host bytes, and a
    /// finite check exactly where the bytes can tell. A row that lacks one fails here.
    #[test]
    fn every_precision_in_the_table_has_every_piece() {
        let (nkv, hd, n) = (2, 64, 3);
        let x = Tensor::randn(0f32, 1.0, (1, nkv, n, hd), &Device::Cpu).unwrap();
        for (i, p) in Precision::ALL.into_iter().enumerate() {
            assert_eq!(Precision::parse(p.name()), Some(p));
            assert_eq!(Precision::NAMES[i], p.name());
            let mut host = new_store(p, nkv, hd, None);
            let mut dev = new_store(p, nkv, hd, Some(&Device::Cpu));
            for s in [&mut host, &mut dev] {
                assert_eq!(s.precision(), p);
                s.grow(n, 0).unwrap();
                s.write(0, &x, &x).unwrap();
                assert_eq!(
                    s.part(0, n, QueryRotation::AtPosition).unwrap().rows.len(),
                    n,
                    "{p:?}"
                );
            }
            let (k, v) = host.raw(0, n).unwrap();
            assert_eq!(k.len(), nkv * n * p.row_bytes(hd), "{p:?}");
            // The device path encodes to the codec's bytes, so states move between the two.
            assert_eq!(dev.raw(0, n).unwrap(), (k.clone(), v), "{p:?}");
            // Offloaded rows staged from those bytes are the device store's rows.
            let (staged, _) = stage(host.as_ref(), (nkv, hd), 0, n, &Device::Cpu).unwrap();
            assert_eq!(staged.dims(), &[1, nkv, n, hd], "{p:?}");
            assert_eq!(p.all_finite(&k), (!p.quantized()).then_some(true), "{p:?}");
            if !p.quantized() {
                let nan = Tensor::full(f32::NAN, (1, nkv, 1, hd), &Device::Cpu).unwrap();
                host.write(0, &nan, &nan).unwrap();
                assert_eq!(p.all_finite(&host.raw(0, 1).unwrap().0), Some(false));
            }
        }
    }
}
