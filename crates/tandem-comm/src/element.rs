//! Element types that collectives move and reduce, and the reduction operators.
//! Reductions follow PyTorch: integers wrap on overflow, Max/Min propagate NaN
//! (like `torch.maximum`), Avg is a Sum divided by the group size (integer division for ints).
use half::{bf16, f16};

/// Data type tag carried in desync checks and error messages.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum WireType {
    F32,
    F64,
    F16,
    BF16,
    I32,
    I64,
    U8,
}

impl WireType {
    pub fn size(self) -> usize {
        match self {
            WireType::F32 | WireType::I32 => 4,
            WireType::F64 | WireType::I64 => 8,
            WireType::F16 | WireType::BF16 => 2,
            WireType::U8 => 1,
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            WireType::F32 => "f32",
            WireType::F64 => "f64",
            WireType::F16 => "f16",
            WireType::BF16 => "bf16",
            WireType::I32 => "i32",
            WireType::I64 => "i64",
            WireType::U8 => "u8",
        }
    }
    pub(crate) fn code(self) -> u8 {
        self as u8
    }
    pub(crate) fn from_code(c: u8) -> Option<WireType> {
        [
            WireType::F32,
            WireType::F64,
            WireType::F16,
            WireType::BF16,
            WireType::I32,
            WireType::I64,
            WireType::U8,
        ]
        .get(c as usize)
        .copied()
    }
}

impl std::fmt::Display for WireType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Reduction operator (PyTorch's `ReduceOp`). The bitwise ones (`BAND`, `BOR`, `BXOR`) take
/// integer elements only, as PyTorch's gloo; `PREMUL_SUM` is
/// [`ProcessGroup::all_reduce_premul_sum`](crate::ProcessGroup::all_reduce_premul_sum).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ReduceOp {
    Sum,
    Avg,
    Max,
    Min,
    Product,
    BitAnd,
    BitOr,
    BitXor,
}

impl ReduceOp {
    pub fn name(self) -> &'static str {
        match self {
            ReduceOp::Sum => "sum",
            ReduceOp::Avg => "avg",
            ReduceOp::Max => "max",
            ReduceOp::Min => "min",
            ReduceOp::Product => "product",
            ReduceOp::BitAnd => "band",
            ReduceOp::BitOr => "bor",
            ReduceOp::BitXor => "bxor",
        }
    }
}

impl ReduceOp {
    /// Every operator, in wire-code order.
    pub const ALL: [ReduceOp; 8] = [
        ReduceOp::Sum,
        ReduceOp::Avg,
        ReduceOp::Max,
        ReduceOp::Min,
        ReduceOp::Product,
        ReduceOp::BitAnd,
        ReduceOp::BitOr,
        ReduceOp::BitXor,
    ];

    pub fn is_bitwise(self) -> bool {
        matches!(self, ReduceOp::BitAnd | ReduceOp::BitOr | ReduceOp::BitXor)
    }
}

/// A plain-old-data element collectives can move and reduce.
pub trait Element: bytemuck::Pod + Send + Sync + 'static {
    const DTYPE: WireType;
    /// Integers (the bitwise reductions apply).
    const INTEGER: bool;
    /// `a op b` for a bitwise `op` (integers; floats never reach it: the group refuses them).
    fn bitwise(op: ReduceOp, a: Self, _b: Self) -> Self {
        let _ = op;
        a
    }
    /// `a × factor` with the factor rounded to this type first, as NCCL's PREMUL_SUM does
    /// (floats; integers never reach it: the group refuses them).
    fn premul(a: Self, factor: f64) -> Self {
        let _ = factor;
        a
    }
    fn add(a: Self, b: Self) -> Self;
    fn mul(a: Self, b: Self) -> Self;
    fn max(a: Self, b: Self) -> Self;
    fn min(a: Self, b: Self) -> Self;
    /// `self / n` (used by Avg after the sum).
    fn div_count(self, n: usize) -> Self;

    /// `dst[i] = op(dst[i], src[i])`; Avg reduces as Sum (the division happens once, at the end).
    fn reduce_slice(op: ReduceOp, dst: &mut [Self], src: &[Self]) {
        let pairs = dst.iter_mut().zip(src.iter());
        match op {
            ReduceOp::Sum | ReduceOp::Avg => pairs.for_each(|(d, s)| *d = Self::add(*d, *s)),
            ReduceOp::Product => pairs.for_each(|(d, s)| *d = Self::mul(*d, *s)),
            ReduceOp::Max => pairs.for_each(|(d, s)| *d = Self::max(*d, *s)),
            ReduceOp::Min => pairs.for_each(|(d, s)| *d = Self::min(*d, *s)),
            ReduceOp::BitAnd | ReduceOp::BitOr | ReduceOp::BitXor => {
                pairs.for_each(|(d, s)| *d = Self::bitwise(op, *d, *s))
            }
        }
    }
}

macro_rules! float_element {
    ($t:ty, $dt:expr) => {
        impl Element for $t {
            const DTYPE: WireType = $dt;
            const INTEGER: bool = false;
            fn premul(a: Self, factor: f64) -> Self {
                a * (factor as $t)
            }
            #[inline(always)]
            fn add(a: Self, b: Self) -> Self {
                a + b
            }
            #[inline(always)]
            fn mul(a: Self, b: Self) -> Self {
                a * b
            }
            #[inline(always)]
            fn max(a: Self, b: Self) -> Self {
                if a.is_nan() || b.is_nan() {
                    a + b
                } else if a >= b {
                    a
                } else {
                    b
                }
            }
            #[inline(always)]
            fn min(a: Self, b: Self) -> Self {
                if a.is_nan() || b.is_nan() {
                    a + b
                } else if a <= b {
                    a
                } else {
                    b
                }
            }
            fn div_count(self, n: usize) -> Self {
                self / (n as $t)
            }
        }
    };
}
float_element!(f32, WireType::F32);
float_element!(f64, WireType::F64);

macro_rules! half_element {
    ($t:ty, $dt:expr) => {
        impl Element for $t {
            const DTYPE: WireType = $dt;
            const INTEGER: bool = false;
            fn premul(a: Self, factor: f64) -> Self {
                // The product of two halves is exact in f32: one rounding, as a half multiply.
                <$t>::from_f32(a.to_f32() * <$t>::from_f64(factor).to_f32())
            }
            #[inline(always)]
            fn add(a: Self, b: Self) -> Self {
                a + b
            }
            #[inline(always)]
            fn mul(a: Self, b: Self) -> Self {
                a * b
            }
            #[inline(always)]
            fn max(a: Self, b: Self) -> Self {
                if a.is_nan() || b.is_nan() {
                    <$t>::NAN
                } else if a >= b {
                    a
                } else {
                    b
                }
            }
            #[inline(always)]
            fn min(a: Self, b: Self) -> Self {
                if a.is_nan() || b.is_nan() {
                    <$t>::NAN
                } else if a <= b {
                    a
                } else {
                    b
                }
            }
            fn div_count(self, n: usize) -> Self {
                <$t>::from_f32(self.to_f32() / n as f32)
            }
        }
    };
}
half_element!(f16, WireType::F16);
half_element!(bf16, WireType::BF16);

macro_rules! int_element {
    ($t:ty, $dt:expr) => {
        impl Element for $t {
            const DTYPE: WireType = $dt;
            const INTEGER: bool = true;
            #[inline(always)]
            fn bitwise(op: ReduceOp, a: Self, b: Self) -> Self {
                match op {
                    ReduceOp::BitAnd => a & b,
                    ReduceOp::BitOr => a | b,
                    _ => a ^ b,
                }
            }
            #[inline(always)]
            fn add(a: Self, b: Self) -> Self {
                a.wrapping_add(b)
            }
            #[inline(always)]
            fn mul(a: Self, b: Self) -> Self {
                a.wrapping_mul(b)
            }
            #[inline(always)]
            fn max(a: Self, b: Self) -> Self {
                Ord::max(a, b)
            }
            #[inline(always)]
            fn min(a: Self, b: Self) -> Self {
                Ord::min(a, b)
            }
            fn div_count(self, n: usize) -> Self {
                self / (n as $t)
            }
        }
    };
}
int_element!(i32, WireType::I32);
int_element!(i64, WireType::I64);
int_element!(u8, WireType::U8);

/// Reduces `src` bytes into `dst` bytes as elements of `T`. `dst` is aligned (it is a view of a
/// `&mut [T]`); `src` may be unaligned (a socket scratch buffer or a shared-memory ring).
pub(crate) fn reduce_bytes<T: Element>(op: ReduceOp, dst: &mut [u8], src: &[u8]) {
    let dst: &mut [T] = bytemuck::cast_slice_mut(dst);
    match bytemuck::try_cast_slice::<u8, T>(src) {
        Ok(src) => T::reduce_slice(op, dst, src),
        Err(_) => {
            let mut tmp = [T::zeroed(); 256];
            let es = std::mem::size_of::<T>();
            for (dchunk, schunk) in dst.chunks_mut(256).zip(src.chunks(256 * es)) {
                let n = dchunk.len();
                for (i, t) in tmp[..n].iter_mut().enumerate() {
                    *t = bytemuck::pod_read_unaligned(&schunk[i * es..(i + 1) * es]);
                }
                T::reduce_slice(op, dchunk, &tmp[..n]);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn max_min_propagate_nan_and_ints_wrap() {
        assert!(<f32 as Element>::max(f32::NAN, 1.0).is_nan());
        assert!(<f64 as Element>::min(2.0, f64::NAN).is_nan());
        assert!(<f16 as Element>::max(f16::NAN, f16::ONE).is_nan());
        assert_eq!(<u8 as Element>::add(250, 10), 4);
        assert_eq!(<i32 as Element>::mul(i32::MAX, 2), -2);
        assert_eq!(7i64.div_count(2), 3);
    }

    #[test]
    fn reduce_bytes_handles_unaligned_source() {
        let mut dst = vec![1.0f32; 300];
        let src: Vec<f32> = (0..300).map(|i| i as f32).collect();
        let mut raw = vec![0u8; 300 * 4 + 1];
        raw[1..].copy_from_slice(bytemuck::cast_slice(&src));
        reduce_bytes::<f32>(ReduceOp::Sum, bytemuck::cast_slice_mut(&mut dst), &raw[1..]);
        for (i, v) in dst.iter().enumerate() {
            assert_eq!(*v, 1.0 + i as f32);
        }
    }
}
