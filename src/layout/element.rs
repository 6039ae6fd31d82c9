//! The element types a batch field or a sample's field is viewed as, and the checked casts
//! from bytes to them.

use crate::format::DType;

/// An element type a batch field can be viewed as: the primitive numbers, and `half`'s `f16`
/// and `bf16`.
///
/// Sealed: only types without padding, valid for every bit pattern and of their dtype's size
/// implement it, so that viewing a field's bytes as `&[T]` is sound.
pub trait Element: sealed::Sealed + Copy + Send + Sync + 'static {
    /// The dtypes this type can view.
    fn matches(dtype: DType) -> bool;
}

mod sealed {
    /// Implemented only below, for types with no padding that are valid for every bit pattern.
    pub trait Sealed {}
}

macro_rules! element {
    ($t:ty, $($d:path),+) => {
        impl sealed::Sealed for $t {}
        impl Element for $t {
            fn matches(dtype: DType) -> bool {
                matches!(dtype, $($d)|+)
            }
        }
    };
}

element!(u8, DType::U8, DType::Bool);
element!(i8, DType::I8);
element!(u16, DType::U16, DType::F16, DType::BF16);
element!(i16, DType::I16);
element!(u32, DType::U32);
element!(i32, DType::I32);
element!(u64, DType::U64);
element!(i64, DType::I64);
element!(f32, DType::F32);
element!(f64, DType::F64);
element!(half::f16, DType::F16);
element!(half::bf16, DType::BF16);

/// Views `bytes` as a slice of `T`, checking alignment and length.
pub(crate) fn cast_slice<T: Element>(bytes: &[u8]) -> Option<&[T]> {
    let size = std::mem::size_of::<T>();
    if !(bytes.as_ptr() as usize).is_multiple_of(std::mem::align_of::<T>())
        || !bytes.len().is_multiple_of(size)
    {
        return None;
    }
    // SAFETY: alignment and length are checked above; `T: Element` (sealed) is a type without
    // padding that is valid for every bit pattern; the result borrows `bytes`, so it cannot
    // outlive or alias a writer.
    Some(unsafe { std::slice::from_raw_parts(bytes.as_ptr().cast::<T>(), bytes.len() / size) })
}

/// Views `bytes` as a mutable slice of `T`, checking alignment and length.
pub(crate) fn cast_slice_mut<T: Element>(bytes: &mut [u8]) -> Option<&mut [T]> {
    let size = std::mem::size_of::<T>();
    if !(bytes.as_ptr() as usize).is_multiple_of(std::mem::align_of::<T>())
        || !bytes.len().is_multiple_of(size)
    {
        return None;
    }
    // SAFETY: as in `cast_slice`; the exclusive borrow of `bytes` moves to the result.
    Some(unsafe {
        std::slice::from_raw_parts_mut(bytes.as_mut_ptr().cast::<T>(), bytes.len() / size)
    })
}

/// The short name of an element type (`f32`, `bf16`), for messages.
pub(crate) fn element_name<T: Element>() -> &'static str {
    let full = std::any::type_name::<T>();
    full.rsplit("::").next().unwrap_or(full)
}
