//! candle `Tensor` <-> `tandem_ckpt::TensorData` (PyTorch's storage model), for checkpoints.
//! Floating dtypes and i64/u8 map one to one; other checkpoint dtypes are an error naming the key.
use candle_core::{DType, Device, Tensor};
use tandem_ckpt::{ElemType, MapLocation};

use crate::error::{NnError, Result};

/// The checkpoint dtype a candle tensor of dtype `d` is saved as (u32 has no torch dtype and is
/// stored as int32).
pub fn ckpt_dtype(d: DType) -> ElemType {
    match d {
        DType::F64 => ElemType::F64,
        DType::F16 => ElemType::F16,
        DType::BF16 => ElemType::BF16,
        DType::I64 => ElemType::I64,
        DType::U32 => ElemType::I32,
        DType::U8 => ElemType::U8,
        _ => ElemType::F32,
    }
}

/// The bytes of a contiguous CPU tensor of a dtype saved as it is, copied once (through
/// `to_vec1` a checkpoint's staging copy of a 1 GiB head would cost 2 GiB at its peak).
fn host_bytes(t: &Tensor) -> Option<Vec<u8>> {
    with_host_bytes(t, |b| b.to_vec())
}

/// `f` of the bytes of a contiguous CPU tensor of a dtype saved as it is (None otherwise).
fn with_host_bytes<R>(t: &Tensor, f: impl FnOnce(&[u8]) -> R) -> Option<R> {
    use candle_core::{CpuStorage, Storage};
    let (storage, layout) = t.storage_and_layout();
    let Storage::Cpu(cpu) = &*storage else { return None };
    let (a, b) = layout.contiguous_offsets()?;
    let bytes: &[u8] = match cpu {
        CpuStorage::F32(v) => bytemuck::cast_slice(&v[a..b]),
        CpuStorage::F64(v) => bytemuck::cast_slice(&v[a..b]),
        CpuStorage::F16(v) => bytemuck::cast_slice(&v[a..b]),
        CpuStorage::BF16(v) => bytemuck::cast_slice(&v[a..b]),
        CpuStorage::I64(v) => bytemuck::cast_slice(&v[a..b]),
        CpuStorage::U8(v) => &v[a..b],
        _ => return None,
    };
    Some(f(bytes))
}

/// A tensor's storage lent to a checkpoint: the tensor (kept alive here) and where its bytes
/// are. A CPU storage's buffer never moves (candle's in-place ops write into it, nothing
/// reallocates it), so the address stays valid while the tensor lives.
struct LentTensor {
    _tensor: Tensor,
    addr: usize,
    len: usize,
}

impl tandem_ckpt::ExternalBytes for LentTensor {
    fn bytes(&self) -> &[u8] {
        // SAFETY: `addr..addr + len` is the kept tensor's buffer (see the type); the caller of
        // `to_ckpt_view` promised nothing writes it while this lives.
        unsafe { std::slice::from_raw_parts(self.addr as *const u8, self.len) }
    }
}

thread_local! {
    /// Inside [`lend`] on this thread: [`to_ckpt`] lends tensors instead of copying them.
    static LEND: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Runs `f` (building a checkpoint's values: a model's state dict, an optimizer's) with every
/// [`to_ckpt`] inside it lending the tensor's storage ([`to_ckpt_view`]) instead of copying
/// it: a synchronous save then writes each tensor's file straight from the tensor and stages
/// no second copy of the state.
///
/// # Safety
/// Nothing may write to a lent tensor's storage (an optimizer step, an in-place op) while any
/// value built inside `f` is alive: a synchronous save, which drops them before training goes
/// on, keeps that promise; a background save must not lend.
pub unsafe fn lend<R>(f: impl FnOnce() -> R) -> R {
    crate::scoped::with_cell(&LEND, true, f)
}

/// [`to_ckpt`] without the copy: the checkpoint tensor reads `t`'s own storage (a CPU tensor,
/// contiguous, of a dtype saved as it is; anything else is copied as `to_ckpt` does). What
/// lets a synchronous save of a head of several GiB stage nothing.
///
/// # Safety
/// Nothing may write to `t`'s storage (an optimizer step, an in-place op) while the returned
/// tensor or a clone of it is alive: a synchronous save, which drops it before training goes
/// on, keeps that promise; a background save must use [`to_ckpt`].
pub unsafe fn to_ckpt_view(t: &Tensor) -> Result<tandem_ckpt::TensorData> {
    let Some((addr, len)) = with_host_bytes(t, |b| (b.as_ptr() as usize, b.len())) else {
        return copy_to_ckpt(t);
    };
    let lent = LentTensor { _tensor: t.clone(), addr, len };
    let storage = tandem_ckpt::StorageData::from_external(Box::new(lent));
    Ok(tandem_ckpt::TensorData::from_storage(ckpt_dtype(t.dtype()), t.dims(), storage))
}

/// A contiguous checkpoint tensor with the same dtype, shape and values: a copy, or inside
/// [`lend`] a view of `t`'s own storage.
pub fn to_ckpt(t: &Tensor) -> Result<tandem_ckpt::TensorData> {
    if LEND.with(|l| l.get()) {
        // SAFETY: the caller of `lend` promised no writes while the value lives.
        return unsafe { to_ckpt_view(t) };
    }
    copy_to_ckpt(t)
}

/// [`to_ckpt`]'s copy.
fn copy_to_ckpt(t: &Tensor) -> Result<tandem_ckpt::TensorData> {
    let shape = t.dims().to_vec();
    if let Some(bytes) = host_bytes(t) {
        return Ok(tandem_ckpt::TensorData::from_bytes(ckpt_dtype(t.dtype()), &shape, bytes));
    }
    let flat = t.flatten_all()?;
    Ok(match t.dtype() {
        DType::F32 => tandem_ckpt::TensorData::from_f32(&shape, &flat.to_vec1::<f32>()?),
        DType::F64 => tandem_ckpt::TensorData::from_f64(&shape, &flat.to_vec1::<f64>()?),
        DType::I64 => tandem_ckpt::TensorData::from_i64(&shape, &flat.to_vec1::<i64>()?),
        DType::F16 => {
            let v = flat.to_vec1::<half::f16>()?;
            tandem_ckpt::TensorData::from_bytes(
                ElemType::F16,
                &shape,
                bytemuck::cast_slice(&v).to_vec(),
            )
        }
        DType::BF16 => {
            let v = flat.to_vec1::<half::bf16>()?;
            tandem_ckpt::TensorData::from_bytes(
                ElemType::BF16,
                &shape,
                bytemuck::cast_slice(&v).to_vec(),
            )
        }
        DType::U8 => {
            tandem_ckpt::TensorData::from_bytes(ElemType::U8, &shape, flat.to_vec1::<u8>()?)
        }
        other => {
            return Err(NnError::TensorConversion {
                key: None,
                reason: format!("candle dtype {other:?} has no checkpoint equivalent"),
            })
        }
    })
}

/// A candle tensor on `device` with the checkpoint tensor's dtype, shape and values.
pub fn from_ckpt(t: &tandem_ckpt::TensorData, device: &Device) -> Result<Tensor> {
    let shape = t.shape.clone();
    let bytes = t.contiguous_bytes();
    let le = cfg!(target_endian = "little");
    if !le {
        return Err(NnError::TensorConversion {
            key: None,
            reason: "big-endian hosts are not supported".into(),
        });
    }
    Ok(match t.dtype {
        ElemType::F32 => Tensor::from_vec(t.to_f32_vec(), shape, device)?,
        ElemType::F64 => Tensor::from_vec(t.to_f64_vec(), shape, device)?,
        ElemType::I64 => Tensor::from_vec(t.to_i64_vec(), shape, device)?,
        ElemType::F16 => {
            Tensor::from_vec(bytemuck::pod_collect_to_vec::<u8, half::f16>(&bytes), shape, device)?
        }
        ElemType::BF16 => {
            Tensor::from_vec(bytemuck::pod_collect_to_vec::<u8, half::bf16>(&bytes), shape, device)?
        }
        ElemType::U8 => Tensor::from_vec(bytes.to_vec(), shape, device)?,
        other => {
            return Err(NnError::TensorConversion {
                key: None,
                reason: format!("checkpoint dtype {} has no candle equivalent", other.torch_name()),
            })
        }
    })
}

/// Names the key in a conversion error (other errors pass through).
fn with_key(e: NnError, k: &str) -> NnError {
    match e {
        NnError::TensorConversion { reason, .. } => {
            NnError::TensorConversion { key: Some(k.to_string()), reason }
        }
        NnError::Candle(e) => {
            NnError::TensorConversion { key: Some(k.to_string()), reason: e.to_string() }
        }
        other => other,
    }
}

/// `module.state_dict()` → checkpoint tensors (names unchanged).
pub fn state_dict_to_ckpt(
    state: &[(String, Tensor)],
) -> Result<Vec<(String, tandem_ckpt::TensorData)>> {
    state.iter().map(|(k, t)| Ok((k.clone(), to_ckpt(t).map_err(|e| with_key(e, k))?))).collect()
}

/// Checkpoint tensors → what `ParamModule::load_state_dict` takes.
pub fn state_dict_from_ckpt(
    state: &[(String, tandem_ckpt::TensorData)],
    device: &Device,
) -> Result<Vec<(String, Tensor)>> {
    state
        .iter()
        .map(|(k, t)| Ok((k.clone(), from_ckpt(t, device).map_err(|e| with_key(e, k))?)))
        .collect()
}

/// The candle device of a `map_location` (`cpu`, `cuda:N`). Each rank names its own GPU, so
/// loading never allocates on GPU 0 for the others (the bytes are read into host memory and
/// copied once, straight to the named device).
pub fn map_location_device(loc: MapLocation) -> Result<Device> {
    match loc {
        MapLocation::Cpu => Ok(Device::Cpu),
        #[cfg(feature = "cuda")]
        MapLocation::Cuda(i) => {
            Device::new_cuda(i).map_err(|e| NnError::Device(format!("map_location cuda:{i}: {e}")))
        }
        #[cfg(not(feature = "cuda"))]
        MapLocation::Cuda(i) => Err(NnError::Device(format!(
            "map_location cuda:{i}: this build has no CUDA support (build with the `cuda` feature)"
        ))),
    }
}

/// `torch.load(path, map_location=...)` for a state dict: every tensor of the file (nested
/// dicts flattened to dotted keys), on the device `map_location` names.
pub fn load_tensors(
    path: &std::path::Path,
    map_location: MapLocation,
) -> Result<Vec<(String, Tensor)>> {
    let device = map_location_device(map_location)?;
    let opts = tandem_ckpt::LoadOptions { map_location, ..Default::default() };
    let value = tandem_ckpt::load_with(path, &opts)?;
    state_dict_from_ckpt(&tandem_ckpt::safetensors::flatten_tensors(&value)?, &device)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A lent tensor reads the tensor's own buffer (no copy: same address), holds the same
    /// bytes as a copied one, keeps the tensor alive after the caller's handle is gone, and
    /// a strided tensor is copied instead.
    #[test]
    fn a_lent_tensor_reads_the_storage_in_place_and_equals_a_copy() {
        let t = Tensor::arange(0f32, 12.0, &Device::Cpu).unwrap().reshape((3, 4)).unwrap();
        let copied = to_ckpt(&t).unwrap();
        // SAFETY: `t` is not written while `lent` lives.
        let lent = unsafe { to_ckpt_view(&t) }.unwrap();
        let own = with_host_bytes(&t, |b| b.as_ptr() as usize).unwrap();
        assert_eq!(lent.storage.bytes().as_ptr() as usize, own, "lent, not copied");
        assert_ne!(copied.storage.bytes().as_ptr() as usize, own);
        assert_eq!(lent.storage.bytes(), copied.storage.bytes());
        assert_eq!((lent.dtype, lent.shape.clone()), (copied.dtype, copied.shape.clone()));
        drop(t);
        assert_eq!(lent.storage.bytes(), copied.storage.bytes(), "the tensor stays alive");
        let strided =
            Tensor::arange(0f32, 12.0, &Device::Cpu).unwrap().reshape((3, 4)).unwrap().t().unwrap();
        // SAFETY: `strided` is not written while `v` lives.
        let v = unsafe { to_ckpt_view(&strided) }.unwrap();
        assert_eq!(v.to_f64_vec(), to_ckpt(&strided).unwrap().to_f64_vec());
    }

    /// Inside `lend` every `to_ckpt` (a whole state dict's) reads the tensors in place; the
    /// scope ends with `lend`, also when it unwinds.
    #[test]
    fn inside_lend_a_state_dict_is_lent_and_outside_copied() {
        let t = Tensor::arange(0f32, 6.0, &Device::Cpu).unwrap().reshape((2, 3)).unwrap();
        let own = with_host_bytes(&t, |b| b.as_ptr() as usize).unwrap();
        let state = vec![("w".to_string(), t.clone())];
        // SAFETY: no tensor of `state` is written while `lent` lives.
        let lent = unsafe { lend(|| state_dict_to_ckpt(&state)) }.unwrap();
        assert_eq!(lent[0].1.storage.bytes().as_ptr() as usize, own);
        let copied = state_dict_to_ckpt(&state).unwrap();
        assert_ne!(copied[0].1.storage.bytes().as_ptr() as usize, own);
        assert_eq!(lent[0].1.storage.bytes(), copied[0].1.storage.bytes());
        // SAFETY: nothing is lent inside.
        let unwound = std::panic::catch_unwind(|| unsafe { lend(|| panic!("inside")) });
        assert!(unwound.is_err());
        let after = to_ckpt(&t).unwrap();
        assert_ne!(after.storage.bytes().as_ptr() as usize, own, "the scope ended");
    }

    #[test]
    fn map_location_places_tensors_and_refuses_a_gpu_this_build_lacks() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("sd.pt");
        let t = Tensor::from_vec(vec![1.0f32, 2.0, 3.0], 3, &Device::Cpu).unwrap();
        let value = tandem_ckpt::Value::dict_from([(
            "fc.weight",
            tandem_ckpt::Value::Tensor(to_ckpt(&t).unwrap()),
        )]);
        tandem_ckpt::save(&path, &value).unwrap();
        let loaded = load_tensors(&path, "cpu".parse().unwrap()).unwrap();
        assert_eq!(loaded.len(), 1);
        assert_eq!(loaded[0].0, "fc.weight");
        assert!(loaded[0].1.device().is_cpu());
        assert_eq!(loaded[0].1.to_vec1::<f32>().unwrap(), [1.0, 2.0, 3.0]);
        if !cfg!(feature = "cuda") {
            let err = load_tensors(&path, "cuda:1".parse().unwrap()).unwrap_err().to_string();
            assert!(err.contains("map_location cuda:1") && err.contains("`cuda` feature"), "{err}");
        }
    }

    #[test]
    fn round_trips_f32_and_i64_and_rejects_bool() {
        let d = Device::Cpu;
        let t = Tensor::from_vec(vec![1.5f32, -2.0, 3.25, 0.0, 7.0, 8.0], (2, 3), &d).unwrap();
        let k = to_ckpt(&t).unwrap();
        assert_eq!(k.shape, vec![2, 3]);
        assert_eq!(k.to_f32_vec(), vec![1.5, -2.0, 3.25, 0.0, 7.0, 8.0]);
        let back = from_ckpt(&k, &d).unwrap();
        assert_eq!(back.to_vec2::<f32>().unwrap(), t.to_vec2::<f32>().unwrap());
        let i = Tensor::new(5i64, &d).unwrap();
        let ki = to_ckpt(&i).unwrap();
        assert_eq!(ki.shape, Vec::<usize>::new());
        assert_eq!(from_ckpt(&ki, &d).unwrap().to_scalar::<i64>().unwrap(), 5);
        let b = tandem_ckpt::TensorData::from_bytes(ElemType::Bool, &[1], vec![1]);
        let err = state_dict_from_ckpt(&[("mask".into(), b)], &d).unwrap_err().to_string();
        assert!(err.contains("mask") && err.contains("bool"), "{err}");
    }
}
