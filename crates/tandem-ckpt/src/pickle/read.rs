//! The unpickler. It builds objects in an arena (`Vec<Node>`, children referenced by index), so
//! shared references (`BINGET` of a list that is filled later) behave as in Python, cycles and
//! deep nesting cannot overflow the Rust stack while building or dropping, and memory stays
//! proportional to the input. Converting the arena into a [`Value`] tree is depth-limited and
//! has a node budget, so a DAG that references one list a billion times is an error, not an OOM.
use std::collections::HashMap;

use super::op;
use crate::value::{ElemType, StorageData, TensorData, Value};

/// Deepest nesting of containers accepted when building the value tree.
pub(crate) const MAX_DEPTH: usize = 256;

pub(crate) type Id = usize;

#[derive(Debug)]
pub(crate) enum PickleError {
    Msg(String),
    /// A global outside the allowlist, as `module.name`.
    Forbidden(String),
    /// A torch global that weights_only allows but tandem does not implement (complex or
    /// quantized storages, sparse/nested tensors, dtypes outside [`ElemType`]), as `module.name`.
    Unsupported(String),
}

fn err<T>(msg: impl Into<String>) -> Result<T, PickleError> {
    Err(PickleError::Msg(msg.into()))
}

/// What a persistent id (`('storage', torch.FloatStorage, key, location, numel[, view])`) names.
#[derive(Clone, Debug)]
pub(crate) struct StorageRef {
    pub key: String,
    pub dtype: ElemType,
    /// Elements of the storage (of the view, for a legacy-format view).
    pub numel: u64,
    /// Legacy format only: offset in elements of a storage view into its root storage.
    pub view_offset: u64,
    /// Device the tensor was saved from (`cpu`, `cuda:0`); bytes are host bytes regardless.
    #[allow(dead_code)]
    pub location: String,
}

#[derive(Clone, Debug)]
pub(crate) struct TensorSpec {
    pub storage: StorageRef,
    pub offset: usize,
    pub shape: Vec<usize>,
    pub stride: Vec<usize>,
}

/// The globals tandem resolves: the subset of `torch.load(weights_only=True)`'s allowlist that a
/// CPU/GPU dense checkpoint uses.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Global {
    OrderedDict,
    RebuildTensorV2,
    RebuildTensor,
    RebuildParameter,
    RebuildParameterWithState,
    RebuildFromTypeV2,
    Size,
    TensorClass,
    ParameterClass,
    Device,
    CodecsEncode,
    Set,
    FrozenSet,
    ByteArray,
    StorageClass(ElemType),
    DTypeObj(ElemType),
    /// numpy's pickling of arrays (`_reconstruct` + BUILD, or protocol 5's `_frombuffer`),
    /// dtypes and scalars: read as data, never by running numpy.
    NpReconstruct,
    NpNdarray,
    NpDtype,
    NpFromBuffer,
    NpScalar,
    /// A class or function the caller allows as data (`unpickle_with`): its calls, NEWOBJ and
    /// BUILD make a [`Node::Object`] holding the arguments and state, never run.
    DataClass,
}

fn lookup_global(module: &str, name: &str) -> Option<Global> {
    use Global::*;
    let dtype_of_storage =
        |n: &str| ElemType::ALL.iter().copied().find(|&d| super::storage_class(d) == n);
    Some(match (module, name) {
        ("collections", "OrderedDict") => OrderedDict,
        ("torch._utils", "_rebuild_tensor_v2") => RebuildTensorV2,
        ("torch._utils", "_rebuild_tensor") => RebuildTensor,
        ("torch._utils", "_rebuild_parameter") => RebuildParameter,
        ("torch._utils", "_rebuild_parameter_with_state") => RebuildParameterWithState,
        ("torch._tensor", "_rebuild_from_type_v2") => RebuildFromTypeV2,
        ("torch", "Size") => Size,
        ("torch", "Tensor") => TensorClass,
        ("torch.nn.parameter", "Parameter") => ParameterClass,
        ("torch", "device") => Device,
        ("_codecs", "encode") => CodecsEncode,
        // numpy 1 names its modules `numpy.core`, numpy 2 `numpy._core`.
        ("numpy.core.multiarray" | "numpy._core.multiarray", "_reconstruct") => NpReconstruct,
        ("numpy.core.multiarray" | "numpy._core.multiarray", "scalar") => NpScalar,
        ("numpy.core.numeric" | "numpy._core.numeric", "_frombuffer") => NpFromBuffer,
        ("numpy", "ndarray") => NpNdarray,
        ("numpy", "dtype") => NpDtype,
        // Protocol 2 pickles use Python 2 module names (`__builtin__`).
        ("builtins" | "__builtin__", "set") => Set,
        ("builtins" | "__builtin__", "frozenset") => FrozenSet,
        ("builtins" | "__builtin__", "bytearray") => ByteArray,
        ("torch.storage", "UntypedStorage") | ("torch", "UntypedStorage") => {
            StorageClass(ElemType::U8)
        }
        ("torch", n) if dtype_of_storage(n).is_some() => StorageClass(dtype_of_storage(n)?),
        ("torch", n) => DTypeObj(ElemType::ALL.iter().copied().find(|d| d.torch_name() == n)?),
        _ => return None,
    })
}

#[derive(Debug)]
enum Node {
    None,
    Bool(bool),
    Int(i64),
    Float(f64),
    Str(String),
    Bytes(Vec<u8>),
    List(Vec<Id>),
    Tuple(Vec<Id>),
    Dict(Vec<(Id, Id)>),
    Set(Vec<Id>),
    Global(Global, String),
    Storage(StorageRef),
    Tensor(TensorSpec),
    /// A numpy dtype: its type string (`u1`, `<f4`, ...) and byte order (from BUILD).
    NpDtype(String, char),
    NpArray(NpArray),
    /// An allowed class's instance (or function's call) as data: its name, the arguments it was
    /// made with and the state BUILD gave it.
    Object {
        class: String,
        args: Vec<Id>,
        state: Option<Id>,
    },
}

/// A numpy array read from a pickle: C-ordered bytes of `dtype` (`None` until BUILD fills in
/// an array `_reconstruct` made).
#[derive(Debug)]
struct NpArray {
    dtype: Option<ElemType>,
    shape: Vec<usize>,
    data: Vec<u8>,
}

/// The element type of a numpy dtype string with its byte order, if tandem has one for it
/// (little-endian or single-byte only).
fn numpy_elem(descr: &str, order: char) -> Result<ElemType, String> {
    let (prefix, code) = match descr.chars().next() {
        Some(c @ ('<' | '>' | '|' | '=')) => (c, &descr[1..]),
        _ => (order, descr),
    };
    let dtype = match code {
        "?" | "b1" => ElemType::Bool,
        "u1" | "B" => ElemType::U8,
        "i1" | "b" => ElemType::I8,
        "i2" | "h" => ElemType::I16,
        "i4" | "i" => ElemType::I32,
        "i8" | "q" | "l" => ElemType::I64,
        "f2" | "e" => ElemType::F16,
        "f4" | "f" => ElemType::F32,
        "f8" | "d" => ElemType::F64,
        other => {
            return Err(format!("numpy dtype `{other}` is not supported (numbers and bool are)"))
        }
    };
    if prefix == '>' && dtype.size() > 1 {
        return Err(format!("numpy dtype `{descr}` is big-endian"));
    }
    Ok(dtype)
}

/// The result of unpickling one pickle: an arena and its root.
pub(crate) struct Unpickled {
    nodes: Vec<Node>,
    root: Id,
    /// Dicts made by `collections.OrderedDict`, with the `_metadata` their BUILD set, if any.
    ordered: HashMap<Id, Option<Id>>,
    /// Convert those to [`Value::OrderedDict`] (a faithful re-save) rather than plain dicts.
    pub keep_ordered: bool,
    /// Bytes consumed (legacy files hold several pickles back to back).
    pub consumed: usize,
}

struct Reader<'a> {
    data: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], PickleError> {
        let remaining = self.data.len() - self.pos;
        if n > remaining {
            return err(format!(
                "pickle truncated: needs {n} bytes at offset {}, {remaining} left",
                self.pos
            ));
        }
        let s = &self.data[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }
    fn u8(&mut self) -> Result<u8, PickleError> {
        Ok(self.take(1)?[0])
    }
    fn u16(&mut self) -> Result<u16, PickleError> {
        Ok(u16::from_le_bytes(self.take(2)?.try_into().expect("2 bytes")))
    }
    fn u32(&mut self) -> Result<u32, PickleError> {
        Ok(u32::from_le_bytes(self.take(4)?.try_into().expect("4 bytes")))
    }
    fn u64(&mut self) -> Result<u64, PickleError> {
        Ok(u64::from_le_bytes(self.take(8)?.try_into().expect("8 bytes")))
    }
    /// A length prefix, checked against what is left so a huge claim fails before allocating.
    fn len(&mut self, n: u64) -> Result<usize, PickleError> {
        let remaining = (self.data.len() - self.pos) as u64;
        if n > remaining {
            return err(format!(
                "pickle claims a {n}-byte item at offset {}, only {remaining} bytes left",
                self.pos
            ));
        }
        Ok(n as usize)
    }
    fn line(&mut self) -> Result<&'a str, PickleError> {
        let rest = &self.data[self.pos..];
        let Some(nl) = rest.iter().position(|&b| b == b'\n') else {
            return err("pickle truncated: unterminated text line");
        };
        self.pos += nl + 1;
        std::str::from_utf8(&rest[..nl])
            .map_err(|_| PickleError::Msg("pickle text line is not UTF-8".into()))
    }
    fn utf8(&mut self, n: usize) -> Result<String, PickleError> {
        let b = self.take(n)?;
        String::from_utf8(b.to_vec())
            .map_err(|_| PickleError::Msg("pickle string is not UTF-8".into()))
    }
}

struct Machine<'a> {
    nodes: Vec<Node>,
    stack: Vec<Id>,
    marks: Vec<usize>,
    memo: HashMap<u64, Id>,
    ordered: HashMap<Id, Option<Id>>,
    /// (module, name) pairs read as data ([`Global::DataClass`]).
    data_classes: &'a [(&'a str, &'a str)],
}

impl Machine<'_> {
    fn push(&mut self, node: Node) {
        self.nodes.push(node);
        self.stack.push(self.nodes.len() - 1);
    }
    fn new_node(&mut self, node: Node) -> Id {
        self.nodes.push(node);
        self.nodes.len() - 1
    }
    fn pop(&mut self) -> Result<Id, PickleError> {
        if self.stack.len() <= self.marks.last().copied().unwrap_or(0) && !self.marks.is_empty() {
            return err("pickle pops across a MARK");
        }
        self.stack.pop().ok_or_else(|| PickleError::Msg("pickle stack underflow".into()))
    }
    fn top(&self) -> Result<Id, PickleError> {
        self.stack.last().copied().ok_or_else(|| PickleError::Msg("pickle stack underflow".into()))
    }
    fn pop_mark(&mut self) -> Result<Vec<Id>, PickleError> {
        let Some(m) = self.marks.pop() else { return err("pickle has no MARK to pop to") };
        Ok(self.stack.split_off(m.min(self.stack.len())))
    }
    fn memo_put(&mut self, idx: u64) -> Result<(), PickleError> {
        let top = self.top()?;
        self.memo.insert(idx, top);
        Ok(())
    }
    fn memo_get(&mut self, idx: u64) -> Result<(), PickleError> {
        let Some(&id) = self.memo.get(&idx) else {
            return err(format!("pickle memo has no entry {idx}"));
        };
        self.stack.push(id);
        Ok(())
    }
    fn str_of(&self, id: Id) -> Result<&str, PickleError> {
        match &self.nodes[id] {
            Node::Str(s) => Ok(s),
            other => err(format!("expected a str, found {}", node_kind(other))),
        }
    }
    fn int_of(&self, id: Id) -> Result<i64, PickleError> {
        match &self.nodes[id] {
            Node::Int(i) => Ok(*i),
            Node::Bool(b) => Ok(*b as i64),
            other => err(format!("expected an int, found {}", node_kind(other))),
        }
    }
    fn items_of(&self, id: Id) -> Result<&[Id], PickleError> {
        match &self.nodes[id] {
            Node::Tuple(v) | Node::List(v) => Ok(v),
            other => err(format!("expected a tuple, found {}", node_kind(other))),
        }
    }
    fn usizes_of(&self, id: Id, what: &str) -> Result<Vec<usize>, PickleError> {
        self.items_of(id)?
            .iter()
            .map(|&i| {
                let v = self.int_of(i)?;
                usize::try_from(v).map_err(|_| PickleError::Msg(format!("negative {what} {v}")))
            })
            .collect()
    }
    fn global(&mut self, module: &str, name: &str) -> Result<(), PickleError> {
        let full = format!("{module}.{name}");
        let data_class = self.data_classes.iter().any(|&(m, n)| m == module && n == name);
        let g = lookup_global(module, name).or(data_class.then_some(Global::DataClass));
        let g = g.ok_or_else(|| {
            // torch's own rebuild functions, storages and dtypes are safe but not implemented.
            let torch_data = module == "torch._utils"
                || (module == "torch"
                    && (name.ends_with("Storage")
                        || name.chars().next().is_some_and(|c| c.is_ascii_lowercase())));
            if torch_data {
                PickleError::Unsupported(full.clone())
            } else {
                PickleError::Forbidden(full.clone())
            }
        })?;
        self.push(Node::Global(g, full));
        Ok(())
    }

    fn persistent_load(&mut self, pid: Id) -> Result<Id, PickleError> {
        let items = self.items_of(pid)?.to_vec();
        if items.len() < 5 || self.str_of(items[0])? != "storage" {
            return err("persistent id is not a ('storage', type, key, location, numel) tuple");
        }
        let dtype = match &self.nodes[items[1]] {
            Node::Global(Global::StorageClass(d), _) => *d,
            Node::Global(_, name) => {
                return err(format!("persistent id names `{name}`, not a storage type"))
            }
            other => return err(format!("persistent id storage type is a {}", node_kind(other))),
        };
        let key = match &self.nodes[items[2]] {
            Node::Str(s) => s.clone(),
            Node::Int(i) => i.to_string(),
            other => return err(format!("storage key is a {}", node_kind(other))),
        };
        let location = self.str_of(items[3])?.to_string();
        let numel = u64::try_from(self.int_of(items[4])?)
            .map_err(|_| PickleError::Msg("negative storage size".into()))?;
        let mut sref = StorageRef { key, dtype, numel, view_offset: 0, location };
        // Legacy format: ('storage', type, root_key, location, root_numel, view_metadata).
        if let Some(&view) = items.get(5) {
            if !matches!(self.nodes[view], Node::None) {
                let v = self.items_of(view)?.to_vec();
                if v.len() != 3 {
                    return err("legacy storage view metadata is not (key, offset, size)");
                }
                let off = self.int_of(v[1])?;
                let size = self.int_of(v[2])?;
                sref.view_offset = u64::try_from(off)
                    .map_err(|_| PickleError::Msg("negative view offset".into()))?;
                sref.numel = u64::try_from(size)
                    .map_err(|_| PickleError::Msg("negative view size".into()))?;
            }
        }
        Ok(self.new_node(Node::Storage(sref)))
    }

    fn rebuild_tensor(&mut self, args: &[Id]) -> Result<Id, PickleError> {
        if args.len() < 4 {
            return err("_rebuild_tensor needs (storage, offset, size, stride)");
        }
        let storage = match &self.nodes[args[0]] {
            Node::Storage(s) => s.clone(),
            other => return err(format!("tensor storage is a {}", node_kind(other))),
        };
        let offset = usize::try_from(self.int_of(args[1])?)
            .map_err(|_| PickleError::Msg("negative storage offset".into()))?;
        let shape = self.usizes_of(args[2], "size")?;
        let stride = self.usizes_of(args[3], "stride")?;
        if shape.len() != stride.len() {
            return err(format!("tensor size {shape:?} and stride {stride:?} differ in length"));
        }
        Ok(self.new_node(Node::Tensor(TensorSpec { storage, offset, shape, stride })))
    }

    fn call(&mut self, func: Id, args: Id) -> Result<Id, PickleError> {
        let (g, name) = match &self.nodes[func] {
            Node::Global(g, name) => (*g, name.clone()),
            other => return err(format!("REDUCE on a {}, not a global", node_kind(other))),
        };
        let args = self.items_of(args)?.to_vec();
        Ok(match g {
            Global::DataClass => self.new_node(Node::Object { class: name, args, state: None }),
            Global::RebuildTensorV2 | Global::RebuildTensor => self.rebuild_tensor(&args)?,
            Global::RebuildParameter | Global::RebuildParameterWithState => match args.first() {
                Some(&data) if matches!(self.nodes[data], Node::Tensor(_)) => data,
                _ => return err("_rebuild_parameter without a tensor"),
            },
            Global::RebuildFromTypeV2 => {
                if args.len() < 3 {
                    return err("_rebuild_from_type_v2 needs (func, type, args, state)");
                }
                match &self.nodes[args[1]] {
                    Node::Global(Global::TensorClass | Global::ParameterClass, _) => {}
                    _ => {
                        return err("_rebuild_from_type_v2 with a type other than Tensor/Parameter")
                    }
                }
                self.call(args[0], args[2])?
            }
            Global::OrderedDict => {
                let mut pairs = Vec::new();
                if let Some(&items) = args.first() {
                    for &p in self.items_of(items)? {
                        match self.items_of(p)? {
                            [k, v] => pairs.push((*k, *v)),
                            _ => return err("OrderedDict item is not a pair"),
                        }
                    }
                }
                let id = self.new_node(Node::Dict(pairs));
                self.ordered.insert(id, None);
                id
            }
            Global::Size => {
                let items = match args.first() {
                    Some(&t) => self.items_of(t)?.to_vec(),
                    None => Vec::new(),
                };
                self.new_node(Node::Tuple(items))
            }
            Global::Device => {
                let mut s = match args.first() {
                    Some(&a) => self.str_of(a)?.to_string(),
                    None => return err("torch.device() without arguments"),
                };
                if let Some(&i) = args.get(1) {
                    s = format!("{s}:{}", self.int_of(i)?);
                }
                self.new_node(Node::Str(s))
            }
            Global::CodecsEncode => {
                let (Some(&text), enc) = (args.first(), args.get(1)) else {
                    return err("_codecs.encode without arguments");
                };
                let text = self.str_of(text)?;
                let enc = match enc {
                    Some(&e) => self.str_of(e)?.to_ascii_lowercase(),
                    None => "utf-8".into(),
                };
                let bytes = match enc.as_str() {
                    "latin1" | "latin-1" | "iso-8859-1" => text
                        .chars()
                        .map(|c| {
                            u8::try_from(c as u32).map_err(|_| {
                                PickleError::Msg("non-latin1 char in _codecs.encode".into())
                            })
                        })
                        .collect::<Result<Vec<u8>, _>>()?,
                    "utf-8" | "utf8" => text.as_bytes().to_vec(),
                    other => return err(format!("_codecs.encode with encoding `{other}`")),
                };
                self.new_node(Node::Bytes(bytes))
            }
            Global::Set | Global::FrozenSet => {
                let items = match args.first() {
                    Some(&t) => match &self.nodes[t] {
                        Node::Set(v) | Node::List(v) | Node::Tuple(v) => v.clone(),
                        other => return err(format!("set() of a {}", node_kind(other))),
                    },
                    None => Vec::new(),
                };
                self.new_node(Node::Set(items))
            }
            Global::ByteArray => {
                let b = match args.first().map(|&a| &self.nodes[a]) {
                    Some(Node::Bytes(b)) => b.clone(),
                    None => Vec::new(),
                    Some(other) => return err(format!("bytearray() of a {}", node_kind(other))),
                };
                self.new_node(Node::Bytes(b))
            }
            Global::NpReconstruct => match args.first().map(|&a| &self.nodes[a]) {
                Some(Node::Global(Global::NpNdarray, _)) => self.new_node(Node::NpArray(NpArray {
                    dtype: None,
                    shape: Vec::new(),
                    data: Vec::new(),
                })),
                _ => return err("numpy _reconstruct of something other than numpy.ndarray"),
            },
            Global::NpDtype => {
                let descr = match args.first() {
                    Some(&d) => self.str_of(d)?.to_string(),
                    None => return err("numpy.dtype() without a type"),
                };
                self.new_node(Node::NpDtype(descr, '|'))
            }
            Global::NpFromBuffer => {
                let [buf, dtype, shape, ..] = args.as_slice() else {
                    return err("numpy _frombuffer needs (buffer, dtype, shape, order)");
                };
                let dtype = self.np_dtype_of(*dtype)?;
                let shape = self.usizes_of(*shape, "numpy shape")?;
                let data = match &self.nodes[*buf] {
                    Node::Bytes(b) => b.clone(),
                    other => return err(format!("numpy _frombuffer of a {}", node_kind(other))),
                };
                if let Some(&order) = args.get(3) {
                    if self.str_of(order)? == "F" && shape.iter().filter(|&&d| d > 1).count() > 1 {
                        return err("Fortran-ordered numpy arrays are not supported");
                    }
                }
                let array = np_array(dtype, shape, data)?;
                self.new_node(Node::NpArray(array))
            }
            Global::NpScalar => {
                let [dtype, raw, ..] = args.as_slice() else {
                    return err("numpy scalar needs (dtype, bytes)");
                };
                let dtype = self.np_dtype_of(*dtype)?;
                let raw = match &self.nodes[*raw] {
                    Node::Bytes(b) => b.clone(),
                    other => return err(format!("numpy scalar of a {}", node_kind(other))),
                };
                let array = np_array(dtype, Vec::new(), raw)?;
                let node = scalar_node(&array)?;
                self.new_node(node)
            }
            Global::TensorClass
            | Global::ParameterClass
            | Global::StorageClass(_)
            | Global::DTypeObj(_)
            | Global::NpNdarray => {
                return err(format!("`{name}` cannot be called while unpickling"))
            }
        })
    }

    fn np_dtype_of(&self, id: Id) -> Result<ElemType, PickleError> {
        match &self.nodes[id] {
            Node::NpDtype(descr, order) => numpy_elem(descr, *order).map_err(PickleError::Msg),
            other => err(format!("numpy dtype is a {}", node_kind(other))),
        }
    }

    /// BUILD on a numpy dtype (its byte order) or an array `_reconstruct` made (its shape,
    /// dtype and bytes: `(version, shape, dtype, is_fortran, data)`).
    fn build_numpy(&mut self, target: Id, state: Id) -> Result<(), PickleError> {
        let items = self.items_of(state)?.to_vec();
        match &self.nodes[target] {
            Node::NpDtype(..) => {
                let order = match items.get(1).map(|&o| &self.nodes[o]) {
                    Some(Node::Str(o)) => o.chars().next().unwrap_or('|'),
                    _ => return err("numpy dtype state without a byte order"),
                };
                if let Node::NpDtype(_, o) = &mut self.nodes[target] {
                    *o = order;
                }
                Ok(())
            }
            _ => {
                let [_, shape, dtype, fortran, data, ..] = items.as_slice() else {
                    return err("numpy array state is not (version, shape, dtype, fortran, data)");
                };
                let shape = self.usizes_of(*shape, "numpy shape")?;
                let dtype = self.np_dtype_of(*dtype)?;
                if matches!(self.nodes[*fortran], Node::Bool(true))
                    && shape.iter().filter(|&&d| d > 1).count() > 1
                {
                    return err("Fortran-ordered numpy arrays are not supported");
                }
                let data = match &self.nodes[*data] {
                    Node::Bytes(b) => b.clone(),
                    Node::Str(s) => latin1(s)?,
                    Node::List(_) => return err("numpy object arrays are not supported"),
                    other => return err(format!("numpy array data is a {}", node_kind(other))),
                };
                let array = np_array(dtype, shape, data)?;
                self.nodes[target] = Node::NpArray(array);
                Ok(())
            }
        }
    }
}

/// A checked numpy array: `data` holds exactly the elements `shape` says.
fn np_array(dtype: ElemType, shape: Vec<usize>, data: Vec<u8>) -> Result<NpArray, PickleError> {
    let numel = shape.iter().try_fold(1usize, |n, &d| n.checked_mul(d));
    let need = numel.and_then(|n| n.checked_mul(dtype.size()));
    if need != Some(data.len()) {
        return err(format!(
            "numpy array of shape {shape:?} and {dtype:?} holds {} bytes",
            data.len()
        ));
    }
    Ok(NpArray { dtype: Some(dtype), shape, data })
}

/// A numpy scalar as the plain value it is.
fn scalar_node(a: &NpArray) -> Result<Node, PickleError> {
    let b = &a.data;
    let int = |n: usize| {
        let mut buf = [0u8; 8];
        buf[..n].copy_from_slice(&b[..n]);
        let v = i64::from_le_bytes(buf);
        let shift = 64 - 8 * n as u32;
        (v << shift) >> shift
    };
    Ok(match a.dtype {
        Some(ElemType::Bool) => Node::Bool(b[0] != 0),
        Some(ElemType::U8) => Node::Int(i64::from(b[0])),
        Some(ElemType::I8) => Node::Int(int(1)),
        Some(ElemType::I16) => Node::Int(int(2)),
        Some(ElemType::I32) => Node::Int(int(4)),
        Some(ElemType::I64) => Node::Int(int(8)),
        Some(ElemType::F32) => Node::Float(f64::from(f32::from_le_bytes([b[0], b[1], b[2], b[3]]))),
        Some(ElemType::F64) => Node::Float(f64::from_le_bytes(b[..8].try_into().unwrap_or([0; 8]))),
        Some(ElemType::F16) => Node::Float(f64::from(half::f16::from_le_bytes([b[0], b[1]]))),
        _ => return err("numpy scalar of an unsupported dtype"),
    })
}

/// Python 2's way of pickling bytes as a latin-1 `str`.
fn latin1(s: &str) -> Result<Vec<u8>, PickleError> {
    s.chars()
        .map(|c| u8::try_from(c as u32))
        .collect::<Result<Vec<u8>, _>>()
        .map_err(|_| PickleError::Msg("numpy array data is not latin-1".into()))
}

fn node_kind(n: &Node) -> &'static str {
    match n {
        Node::None => "None",
        Node::Bool(_) => "bool",
        Node::Int(_) => "int",
        Node::Float(_) => "float",
        Node::Str(_) => "str",
        Node::Bytes(_) => "bytes",
        Node::List(_) => "list",
        Node::Tuple(_) => "tuple",
        Node::Dict(_) => "dict",
        Node::Set(_) => "set",
        Node::Global(..) => "global",
        Node::Storage(_) => "storage",
        Node::Tensor(_) => "tensor",
        Node::NpDtype(..) => "numpy dtype",
        Node::NpArray(_) => "numpy array",
        Node::Object { .. } => "object",
    }
}

/// Little-endian two's-complement integer of `b.len()` bytes (LONG1/LONG4), if it fits an i64.
fn long_from_bytes(b: &[u8]) -> Result<i64, PickleError> {
    if b.is_empty() {
        return Ok(0);
    }
    let negative = b[b.len() - 1] & 0x80 != 0;
    let fill = if negative { 0xff } else { 0 };
    if b.len() > 8 && b[8..].iter().any(|&x| x != fill) {
        return err("pickle int does not fit in 64 bits");
    }
    let mut buf = [fill; 8];
    let n = b.len().min(8);
    buf[..n].copy_from_slice(&b[..n]);
    let v = i64::from_le_bytes(buf);
    if (v < 0) != negative {
        return err("pickle int does not fit in 64 bits");
    }
    Ok(v)
}

/// Runs one pickle from the start of `data` to its STOP.
pub(crate) fn unpickle(data: &[u8]) -> Result<Unpickled, PickleError> {
    unpickle_with(data, &[])
}

/// [`unpickle`], with the classes and functions `data_classes` names (module, name) read as
/// data: an instance becomes a dict `{"__class__": "module.name", "__args__": (..), "__state__":
/// ..}` in the value tree. Nothing is imported or run.
pub(crate) fn unpickle_with(
    data: &[u8],
    data_classes: &[(&str, &str)],
) -> Result<Unpickled, PickleError> {
    let mut r = Reader { data, pos: 0 };
    let mut m = Machine {
        nodes: Vec::new(),
        stack: Vec::new(),
        marks: Vec::new(),
        memo: HashMap::new(),
        ordered: HashMap::new(),
        data_classes,
    };
    loop {
        let code = r.u8()?;
        match code {
            op::PROTO => {
                let v = r.u8()?;
                if v > 5 {
                    return err(format!("unsupported pickle protocol {v}"));
                }
            }
            op::FRAME => {
                r.u64()?;
            }
            op::STOP => {
                let root = m
                    .stack
                    .pop()
                    .ok_or_else(|| PickleError::Msg("pickle STOP with an empty stack".into()))?;
                return Ok(Unpickled {
                    nodes: m.nodes,
                    root,
                    ordered: m.ordered,
                    keep_ordered: false,
                    consumed: r.pos,
                });
            }
            op::MARK => m.marks.push(m.stack.len()),
            op::POP => {
                if m.marks.last() == Some(&m.stack.len()) {
                    m.marks.pop();
                } else {
                    m.pop()?;
                }
            }
            op::POP_MARK => {
                m.pop_mark()?;
            }
            op::DUP => {
                let t = m.top()?;
                m.stack.push(t);
            }
            op::NONE => m.push(Node::None),
            op::NEWTRUE => m.push(Node::Bool(true)),
            op::NEWFALSE => m.push(Node::Bool(false)),
            op::BININT => {
                let v = r.u32()? as i32;
                m.push(Node::Int(v as i64))
            }
            op::BININT1 => {
                let v = r.u8()?;
                m.push(Node::Int(v as i64))
            }
            op::BININT2 => {
                let v = r.u16()?;
                m.push(Node::Int(v as i64))
            }
            op::INT => {
                let line = r.line()?;
                let node = match line {
                    "00" => Node::Bool(false),
                    "01" => Node::Bool(true),
                    s => Node::Int(
                        s.trim().parse().map_err(|_| PickleError::Msg(format!("bad INT `{s}`")))?,
                    ),
                };
                m.push(node)
            }
            op::LONG1 => {
                let n = r.u8()? as usize;
                let v = long_from_bytes(r.take(n)?)?;
                m.push(Node::Int(v))
            }
            op::LONG4 => {
                let n = r.u32()?;
                let n = r.len(n as u64)?;
                let v = long_from_bytes(r.take(n)?)?;
                m.push(Node::Int(v))
            }
            op::BINFLOAT => {
                let v = f64::from_be_bytes(r.take(8)?.try_into().expect("8 bytes"));
                m.push(Node::Float(v))
            }
            op::BINUNICODE => {
                let n = r.u32()?;
                let n = r.len(n as u64)?;
                let s = r.utf8(n)?;
                m.push(Node::Str(s))
            }
            op::SHORT_BINUNICODE => {
                let n = r.u8()? as usize;
                let s = r.utf8(n)?;
                m.push(Node::Str(s))
            }
            op::BINUNICODE8 => {
                let n = r.u64()?;
                let n = r.len(n)?;
                let s = r.utf8(n)?;
                m.push(Node::Str(s))
            }
            // Python 2 `str`: torch.load decodes it (encoding='utf-8' default) to a str.
            op::BINSTRING | op::SHORT_BINSTRING => {
                // Python 2's `str`: text when it is UTF-8, else raw bytes (as Python 3 reads it
                // with `encoding='bytes'`; insightface's `.bin` sets hold encoded images so).
                let n = if code == op::BINSTRING { r.u32()? as u64 } else { r.u8()? as u64 };
                let n = r.len(n)?;
                let b = r.take(n)?;
                m.push(match std::str::from_utf8(b) {
                    Ok(s) => Node::Str(s.to_string()),
                    Err(_) => Node::Bytes(b.to_vec()),
                })
            }
            op::BINBYTES | op::SHORT_BINBYTES | op::BINBYTES8 | op::BYTEARRAY8 => {
                let n = match code {
                    op::BINBYTES => r.u32()? as u64,
                    op::SHORT_BINBYTES => r.u8()? as u64,
                    _ => r.u64()?,
                };
                let n = r.len(n)?;
                let b = r.take(n)?.to_vec();
                m.push(Node::Bytes(b))
            }
            op::EMPTY_LIST => m.push(Node::List(Vec::new())),
            op::EMPTY_DICT => m.push(Node::Dict(Vec::new())),
            op::EMPTY_TUPLE => m.push(Node::Tuple(Vec::new())),
            op::EMPTY_SET => m.push(Node::Set(Vec::new())),
            op::LIST => {
                let items = m.pop_mark()?;
                m.push(Node::List(items))
            }
            op::TUPLE => {
                let items = m.pop_mark()?;
                m.push(Node::Tuple(items))
            }
            op::FROZENSET => {
                let items = m.pop_mark()?;
                m.push(Node::Set(items))
            }
            op::DICT => {
                let items = m.pop_mark()?;
                if items.len() % 2 != 0 {
                    return err("DICT with an odd number of items");
                }
                let pairs = items.chunks_exact(2).map(|c| (c[0], c[1])).collect();
                m.push(Node::Dict(pairs))
            }
            op::TUPLE1 | op::TUPLE2 | op::TUPLE3 => {
                let n = (code - op::TUPLE1 + 1) as usize;
                let mut items = Vec::with_capacity(n);
                for _ in 0..n {
                    items.push(m.pop()?);
                }
                items.reverse();
                m.push(Node::Tuple(items))
            }
            op::APPEND => {
                let v = m.pop()?;
                let l = m.top()?;
                match &mut m.nodes[l] {
                    Node::List(items) => items.push(v),
                    other => return err(format!("APPEND to a {}", node_kind(other))),
                }
            }
            op::APPENDS => {
                let items = m.pop_mark()?;
                let l = m.top()?;
                match &mut m.nodes[l] {
                    Node::List(v) => v.extend(items),
                    other => return err(format!("APPENDS to a {}", node_kind(other))),
                }
            }
            op::ADDITEMS => {
                let items = m.pop_mark()?;
                let s = m.top()?;
                match &mut m.nodes[s] {
                    Node::Set(v) => v.extend(items),
                    other => return err(format!("ADDITEMS to a {}", node_kind(other))),
                }
            }
            op::SETITEM => {
                let v = m.pop()?;
                let k = m.pop()?;
                let d = m.top()?;
                match &mut m.nodes[d] {
                    Node::Dict(items) => items.push((k, v)),
                    other => return err(format!("SETITEM on a {}", node_kind(other))),
                }
            }
            op::SETITEMS => {
                let items = m.pop_mark()?;
                if items.len() % 2 != 0 {
                    return err("SETITEMS with an odd number of items");
                }
                let d = m.top()?;
                match &mut m.nodes[d] {
                    Node::Dict(v) => v.extend(items.chunks_exact(2).map(|c| (c[0], c[1]))),
                    other => return err(format!("SETITEMS on a {}", node_kind(other))),
                }
            }
            op::BINPUT => {
                let i = r.u8()? as u64;
                m.memo_put(i)?
            }
            op::LONG_BINPUT => {
                let i = r.u32()? as u64;
                m.memo_put(i)?
            }
            op::PUT => {
                let line = r.line()?;
                let i = line
                    .parse()
                    .map_err(|_| PickleError::Msg(format!("bad PUT index `{line}`")))?;
                m.memo_put(i)?
            }
            op::MEMOIZE => {
                let i = m.memo.len() as u64;
                m.memo_put(i)?
            }
            op::BINGET => {
                let i = r.u8()? as u64;
                m.memo_get(i)?
            }
            op::LONG_BINGET => {
                let i = r.u32()? as u64;
                m.memo_get(i)?
            }
            op::GET => {
                let line = r.line()?;
                let i = line
                    .parse()
                    .map_err(|_| PickleError::Msg(format!("bad GET index `{line}`")))?;
                m.memo_get(i)?
            }
            op::GLOBAL => {
                let module = r.line()?;
                let name = r.line()?;
                m.global(module, name)?
            }
            op::STACK_GLOBAL => {
                let name = m.pop()?;
                let module = m.pop()?;
                let (module, name) = (m.str_of(module)?.to_string(), m.str_of(name)?.to_string());
                m.global(&module, &name)?
            }
            op::REDUCE => {
                let args = m.pop()?;
                let func = m.pop()?;
                let out = m.call(func, args)?;
                m.stack.push(out)
            }
            op::NEWOBJ => {
                let args = m.pop()?;
                let cls = m.pop()?;
                match &m.nodes[cls] {
                    Node::Global(
                        Global::Set
                        | Global::FrozenSet
                        | Global::OrderedDict
                        | Global::Size
                        | Global::DataClass,
                        _,
                    ) => {
                        let out = m.call(cls, args)?;
                        m.stack.push(out)
                    }
                    Node::Global(_, name) => {
                        return err(format!("NEWOBJ of `{name}` is not allowed"))
                    }
                    other => return err(format!("NEWOBJ of a {}", node_kind(other))),
                }
            }
            op::BUILD => {
                let state = m.pop()?;
                let target = m.top()?;
                // OrderedDict state is `{'_metadata': ...}` (module versions); a Parameter's state
                // holds Python attributes. Neither is part of the values.
                match &m.nodes[target] {
                    Node::Dict(_) if m.ordered.contains_key(&target) => {
                        // `{'_metadata': ...}`: the module versions torch's load_state_dict
                        // passes on; kept for a faithful re-save.
                        let metadata = match &m.nodes[state] {
                            Node::Dict(pairs) => pairs
                                .iter()
                                .find(|(k, _)| matches!(&m.nodes[*k], Node::Str(s) if s == "_metadata"))
                                .map(|&(_, v)| v),
                            _ => None,
                        };
                        m.ordered.insert(target, metadata);
                    }
                    Node::Dict(_) | Node::Tensor(_) => {}
                    Node::Object { state: None, .. } => {
                        if let Node::Object { state: slot, .. } = &mut m.nodes[target] {
                            *slot = Some(state);
                        }
                    }
                    Node::Object { class, .. } => {
                        return err(format!("a second BUILD of a `{class}`"))
                    }
                    Node::NpDtype(..) | Node::NpArray(NpArray { dtype: None, .. }) => {
                        m.build_numpy(target, state)?
                    }
                    other => return err(format!("BUILD on a {}", node_kind(other))),
                }
            }
            op::BINPERSID => {
                let pid = m.pop()?;
                let s = m.persistent_load(pid)?;
                m.stack.push(s)
            }
            other => {
                return err(format!(
                    "unsupported pickle opcode 0x{other:02x} at offset {}",
                    r.pos - 1
                ));
            }
        }
    }
}

/// Turns arena nodes into a [`Value`] tree; `storage` resolves persistent storages (cached by key
/// by the caller, so tied tensors share one `StorageData`).
pub(crate) struct Converter<'a> {
    up: &'a Unpickled,
    budget: usize,
    /// Bytes of strings and byte strings the tree may still hold: a memo reference repeats its
    /// value's bytes, so a small pickle could otherwise expand to terabytes.
    bytes_budget: usize,
    storage: &'a mut dyn FnMut(&StorageRef) -> Result<StorageData, String>,
}

impl Unpickled {
    pub(crate) fn to_value(
        &self,
        storage: &mut dyn FnMut(&StorageRef) -> Result<StorageData, String>,
    ) -> Result<Value, String> {
        let budget = self.nodes.len().saturating_mul(8).saturating_add(100_000);
        // Every string once, four times over, plus room for small repeated ones.
        let held: usize = self
            .nodes
            .iter()
            .map(|n| match n {
                Node::Str(s) => s.len(),
                Node::Bytes(b) => b.len(),
                _ => 0,
            })
            .sum();
        let bytes_budget = held.saturating_mul(4).saturating_add(64 << 20);
        let mut c = Converter { up: self, budget, bytes_budget, storage };
        c.convert(self.root, 0)
    }

    /// Every storage the pickle references, in first-use order (the legacy format needs their
    /// dtypes to find the storage records).
    pub(crate) fn storages(&self) -> impl Iterator<Item = &StorageRef> {
        self.nodes.iter().filter_map(|n| match n {
            Node::Storage(s) => Some(s),
            Node::Tensor(t) => Some(&t.storage),
            _ => None,
        })
    }
}

impl Converter<'_> {
    fn convert(&mut self, id: Id, depth: usize) -> Result<Value, String> {
        if depth > MAX_DEPTH {
            return Err(format!("values nested deeper than {MAX_DEPTH} levels"));
        }
        if self.budget == 0 {
            return Err(
                "pickle expands to too many values (shared references repeated beyond the limit)"
                    .into(),
            );
        }
        self.budget -= 1;
        let up = self.up;
        Ok(match &up.nodes[id] {
            Node::None => Value::None,
            Node::Bool(b) => Value::Bool(*b),
            Node::Int(i) => Value::Int(*i),
            Node::Float(f) => Value::Float(*f),
            Node::Str(s) => {
                self.charge(s.len())?;
                Value::Str(s.clone())
            }
            Node::Bytes(b) => {
                self.charge(b.len())?;
                Value::Bytes(b.clone())
            }
            Node::List(v) | Node::Set(v) => Value::List(self.convert_all(v, depth)?),
            Node::Tuple(v) => Value::Tuple(self.convert_all(v, depth)?),
            Node::Dict(pairs) => {
                let mut out: Vec<(Value, Value)> = Vec::with_capacity(pairs.len());
                // Python dicts keep the last value of a repeated key, at the first key's place.
                let mut index: HashMap<DictKey, usize> = HashMap::new();
                for &(k, v) in pairs {
                    let k = self.convert(k, depth + 1)?;
                    let v = self.convert(v, depth + 1)?;
                    match DictKey::of(&k).and_then(|dk| index.get(&dk).copied()) {
                        Some(i) => out[i].1 = v,
                        None => {
                            if let Some(dk) = DictKey::of(&k) {
                                index.insert(dk, out.len());
                            }
                            out.push((k, v));
                        }
                    }
                }
                match up.ordered.get(&id) {
                    Some(&metadata) if up.keep_ordered => {
                        let metadata = match metadata {
                            Some(m) => Some(Box::new(self.convert(m, depth + 1)?)),
                            None => None,
                        };
                        Value::OrderedDict { items: out, metadata }
                    }
                    _ => Value::Dict(out),
                }
            }
            Node::Global(g, name) => match g {
                Global::DTypeObj(_) => Value::Str(name.clone()),
                _ => {
                    return Err(format!("`{name}` appears as a value; tandem cannot represent it"))
                }
            },
            Node::Storage(s) => {
                return Err(format!("a bare storage (key {}) is not supported as a value", s.key))
            }
            Node::Tensor(spec) => Value::Tensor(self.tensor(spec)?),
            Node::NpDtype(descr, _) => Value::Str(descr.clone()),
            Node::Object { class, args, state } => {
                self.charge(class.len())?;
                let args = Value::Tuple(self.convert_all(args, depth)?);
                let state = match state {
                    Some(s) => self.convert(*s, depth + 1)?,
                    None => Value::None,
                };
                Value::dict_from([
                    ("__class__", Value::Str(class.clone())),
                    ("__args__", args),
                    ("__state__", state),
                ])
            }
            Node::NpArray(a) => {
                let dtype = a.dtype.ok_or("a numpy array whose state never came (no BUILD)")?;
                self.charge(a.data.len())?;
                let mut stride = vec![1usize; a.shape.len()];
                for i in (0..a.shape.len().saturating_sub(1)).rev() {
                    stride[i] = stride[i + 1] * a.shape[i + 1];
                }
                Value::Tensor(TensorData {
                    dtype,
                    shape: a.shape.clone(),
                    stride,
                    storage_offset: 0,
                    storage: StorageData::from_vec(a.data.clone()),
                })
            }
        })
    }

    fn charge(&mut self, bytes: usize) -> Result<(), String> {
        self.bytes_budget = self.bytes_budget.checked_sub(bytes).ok_or(
            "pickle expands to too many bytes (a string or bytes value referenced again and \
             again beyond the limit)",
        )?;
        Ok(())
    }

    fn convert_all(&mut self, ids: &[Id], depth: usize) -> Result<Vec<Value>, String> {
        ids.iter().map(|&i| self.convert(i, depth + 1)).collect()
    }

    fn tensor(&mut self, spec: &TensorSpec) -> Result<TensorData, String> {
        let storage = (self.storage)(&spec.storage)?;
        let dtype = spec.storage.dtype;
        let offset = (spec.storage.view_offset as usize)
            .checked_add(spec.offset)
            .ok_or("tensor storage offset overflows")?;
        check_view(&spec.shape, &spec.stride, offset, dtype, storage.len())
            .map_err(|e| format!("tensor in storage {}: {e}", spec.storage.key))?;
        Ok(TensorData {
            dtype,
            shape: spec.shape.clone(),
            stride: spec.stride.clone(),
            storage_offset: offset,
            storage,
        })
    }
}

/// Checks that a view (shape, stride, offset, in elements) lies inside a storage of `storage_len`
/// bytes, with overflow-checked arithmetic.
pub(crate) fn check_view(
    shape: &[usize],
    stride: &[usize],
    offset: usize,
    dtype: ElemType,
    storage_len: usize,
) -> Result<(), String> {
    let mut numel: usize = 1;
    for &s in shape {
        numel = numel.checked_mul(s).ok_or("tensor size overflows")?;
    }
    if numel == 0 {
        return Ok(());
    }
    let mut last = offset;
    for (&s, &st) in shape.iter().zip(stride) {
        last = (s - 1)
            .checked_mul(st)
            .and_then(|x| last.checked_add(x))
            .ok_or("tensor extent overflows")?;
    }
    let end = last
        .checked_add(1)
        .and_then(|e| e.checked_mul(dtype.size()))
        .ok_or("tensor extent overflows")?;
    if end > storage_len {
        return Err(format!(
            "view (size {shape:?}, stride {stride:?}, offset {offset}) needs {end} bytes, storage has {storage_len}"
        ));
    }
    Ok(())
}

#[derive(Hash, PartialEq, Eq)]
enum DictKey {
    Str(String),
    Int(i64),
}

impl DictKey {
    fn of(v: &Value) -> Option<DictKey> {
        match v {
            Value::Str(s) => Some(DictKey::Str(s.clone())),
            Value::Int(i) => Some(DictKey::Int(*i)),
            _ => None,
        }
    }
}
