//! Pickle, restricted to what `torch.save` emits and `torch.load(weights_only=True)` accepts.
//!
//! Hand-written rather than taken from a crate: `pytorch-reader` (the candidate ARCHITECTURE.md
//! named) flattens checkpoints to a `HashMap<String, TensorData>` — losing list/tuple nesting, dict
//! order, int keys and storage identity (tied weights) — hides strides, and turns unknown globals
//! into `Unsupported` values instead of errors; `serde-pickle` has no persistent ids or torch
//! globals. The subset needed here is small (≈45 opcodes), and owning it lets every length be
//! checked against the remaining input, the memo and nesting be bounded, and every global be
//! looked up in an explicit allowlist before anything is built.
pub(crate) mod read;
pub(crate) mod write;

pub(crate) mod op {
    pub const MARK: u8 = b'(';
    pub const STOP: u8 = b'.';
    pub const POP: u8 = b'0';
    pub const POP_MARK: u8 = b'1';
    pub const DUP: u8 = b'2';
    pub const INT: u8 = b'I';
    pub const BININT: u8 = b'J';
    pub const BININT1: u8 = b'K';
    pub const BININT2: u8 = b'M';
    pub const NONE: u8 = b'N';
    pub const BINPERSID: u8 = b'Q';
    pub const REDUCE: u8 = b'R';
    pub const BINSTRING: u8 = b'T';
    pub const SHORT_BINSTRING: u8 = b'U';
    pub const BINUNICODE: u8 = b'X';
    pub const APPEND: u8 = b'a';
    pub const BUILD: u8 = b'b';
    pub const GLOBAL: u8 = b'c';
    pub const DICT: u8 = b'd';
    pub const EMPTY_DICT: u8 = b'}';
    pub const APPENDS: u8 = b'e';
    pub const GET: u8 = b'g';
    pub const BINGET: u8 = b'h';
    pub const LONG_BINGET: u8 = b'j';
    pub const LIST: u8 = b'l';
    pub const EMPTY_LIST: u8 = b']';
    pub const PUT: u8 = b'p';
    pub const BINPUT: u8 = b'q';
    pub const LONG_BINPUT: u8 = b'r';
    pub const SETITEM: u8 = b's';
    pub const TUPLE: u8 = b't';
    pub const EMPTY_TUPLE: u8 = b')';
    pub const SETITEMS: u8 = b'u';
    pub const BINFLOAT: u8 = b'G';
    pub const PROTO: u8 = 0x80;
    pub const NEWOBJ: u8 = 0x81;
    pub const TUPLE1: u8 = 0x85;
    pub const TUPLE2: u8 = 0x86;
    pub const TUPLE3: u8 = 0x87;
    pub const NEWTRUE: u8 = 0x88;
    pub const NEWFALSE: u8 = 0x89;
    pub const LONG1: u8 = 0x8a;
    pub const LONG4: u8 = 0x8b;
    pub const BINBYTES: u8 = b'B';
    pub const SHORT_BINBYTES: u8 = b'C';
    pub const SHORT_BINUNICODE: u8 = 0x8c;
    pub const BINUNICODE8: u8 = 0x8d;
    pub const BINBYTES8: u8 = 0x8e;
    pub const EMPTY_SET: u8 = 0x8f;
    pub const ADDITEMS: u8 = 0x90;
    pub const FROZENSET: u8 = 0x91;
    pub const STACK_GLOBAL: u8 = 0x93;
    pub const MEMOIZE: u8 = 0x94;
    pub const FRAME: u8 = 0x95;
    pub const BYTEARRAY8: u8 = 0x96;
}

use crate::value::ElemType;

/// StorageData class name (`torch.FloatStorage`) for a dtype, as torch pickles it.
pub(crate) fn storage_class(dtype: ElemType) -> &'static str {
    match dtype {
        ElemType::F64 => "DoubleStorage",
        ElemType::F32 => "FloatStorage",
        ElemType::F16 => "HalfStorage",
        ElemType::BF16 => "BFloat16Storage",
        ElemType::I64 => "LongStorage",
        ElemType::I32 => "IntStorage",
        ElemType::I16 => "ShortStorage",
        ElemType::I8 => "CharStorage",
        ElemType::U8 => "ByteStorage",
        ElemType::Bool => "BoolStorage",
    }
}
