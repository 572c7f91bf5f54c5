//! The pickler: a [`Value`] tree as pickle protocol 2, the way `torch.save` writes it, with
//! tensors as `torch._utils._rebuild_tensor_v2(persistent storage, offset, size, stride, ...)`.
//! Only globals in `torch.load(weights_only=True)`'s allowlist are emitted.
use std::collections::HashMap;

use super::op;
use super::read::{check_view, MAX_DEPTH};
use crate::value::{ElemType, StorageData, TensorData, Value};

/// The storages a pickle references, deduplicated so tied tensors share one record.
#[derive(Default)]
pub(crate) struct StorageTable {
    pub storages: Vec<(ElemType, StorageData)>,
    index: HashMap<(usize, ElemType), usize>,
}

impl StorageTable {
    fn key_of(&mut self, t: &TensorData) -> usize {
        let k = (t.storage.id(), t.dtype);
        if let Some(&i) = self.index.get(&k) {
            return i;
        }
        self.storages.push((t.dtype, t.storage.clone()));
        self.index.insert(k, self.storages.len() - 1);
        self.storages.len() - 1
    }
}

pub(crate) struct Pickler {
    pub out: Vec<u8>,
    pub table: StorageTable,
}

impl Pickler {
    pub(crate) fn new() -> Self {
        Pickler { out: vec![op::PROTO, 2], table: StorageTable::default() }
    }

    pub(crate) fn finish(mut self) -> (Vec<u8>, StorageTable) {
        self.out.push(op::STOP);
        (self.out, self.table)
    }

    pub(crate) fn global(&mut self, module: &str, name: &str) {
        self.out.push(op::GLOBAL);
        self.out.extend_from_slice(module.as_bytes());
        self.out.push(b'\n');
        self.out.extend_from_slice(name.as_bytes());
        self.out.push(b'\n');
    }

    pub(crate) fn int(&mut self, v: i64) {
        if (0..=0xff).contains(&v) {
            self.out.extend_from_slice(&[op::BININT1, v as u8]);
        } else if (0..=0xffff).contains(&v) {
            self.out.push(op::BININT2);
            self.out.extend_from_slice(&(v as u16).to_le_bytes());
        } else if i32::try_from(v).is_ok() {
            self.out.push(op::BININT);
            self.out.extend_from_slice(&(v as i32).to_le_bytes());
        } else {
            // Minimal little-endian two's complement, as Python's encode_long.
            let bytes = v.to_le_bytes();
            let mut n = 8;
            while n > 1 {
                let (last, prev) = (bytes[n - 1], bytes[n - 2]);
                if (last == 0 && prev & 0x80 == 0) || (last == 0xff && prev & 0x80 != 0) {
                    n -= 1;
                } else {
                    break;
                }
            }
            self.out.extend_from_slice(&[op::LONG1, n as u8]);
            self.out.extend_from_slice(&bytes[..n]);
        }
    }

    pub(crate) fn str(&mut self, s: &str) {
        self.out.push(op::BINUNICODE);
        self.out.extend_from_slice(&(s.len() as u32).to_le_bytes());
        self.out.extend_from_slice(s.as_bytes());
    }

    fn usize_tuple(&mut self, v: &[usize]) {
        self.out.push(op::MARK);
        for &x in v {
            self.int(x as i64);
        }
        self.out.push(op::TUPLE);
    }

    fn tensor(&mut self, t: &TensorData) -> Result<(), String> {
        let es = t.dtype.size();
        if !t.storage.len().is_multiple_of(es) {
            return Err(format!(
                "a {} tensor's storage has {} bytes, not a multiple of {es}",
                t.dtype,
                t.storage.len()
            ));
        }
        if t.shape.len() != t.stride.len() {
            return Err(format!(
                "tensor size {:?} and stride {:?} differ in length",
                t.shape, t.stride
            ));
        }
        check_view(&t.shape, &t.stride, t.storage_offset, t.dtype, t.storage.len())?;
        let key = self.table.key_of(t);
        self.global("torch._utils", "_rebuild_tensor_v2");
        self.out.push(op::MARK);
        // persistent id: ('storage', torch.FloatStorage, '<key>', 'cpu', numel)
        self.out.push(op::MARK);
        self.str("storage");
        self.global("torch", super::storage_class(t.dtype));
        self.str(&key.to_string());
        self.str("cpu");
        self.int((t.storage.len() / es) as i64);
        self.out.push(op::TUPLE);
        self.out.push(op::BINPERSID);
        self.int(t.storage_offset as i64);
        self.usize_tuple(&t.shape);
        self.usize_tuple(&t.stride);
        self.out.push(op::NEWFALSE);
        self.global("collections", "OrderedDict");
        self.out.push(op::EMPTY_TUPLE);
        self.out.push(op::REDUCE);
        self.out.push(op::TUPLE);
        self.out.push(op::REDUCE);
        Ok(())
    }

    /// The items of the dict on top of the stack (SETITEMS), if any.
    fn set_items(&mut self, items: &[(Value, Value)], depth: usize) -> Result<(), String> {
        if !items.is_empty() {
            self.out.push(op::MARK);
            for (k, v) in items {
                self.value(k, depth + 1)?;
                self.value(v, depth + 1)?;
            }
            self.out.push(op::SETITEMS);
        }
        Ok(())
    }

    pub(crate) fn value(&mut self, v: &Value, depth: usize) -> Result<(), String> {
        if depth > MAX_DEPTH {
            return Err(format!("values nested deeper than {MAX_DEPTH} levels"));
        }
        match v {
            Value::None => self.out.push(op::NONE),
            Value::Bool(b) => self.out.push(if *b { op::NEWTRUE } else { op::NEWFALSE }),
            Value::Int(i) => self.int(*i),
            Value::Float(f) => {
                self.out.push(op::BINFLOAT);
                self.out.extend_from_slice(&f.to_be_bytes());
            }
            Value::Str(s) => self.str(s),
            Value::Bytes(b) => {
                // Protocol 2 has no bytes opcode: Python writes _codecs.encode(latin1 text, 'latin1').
                self.global("_codecs", "encode");
                let text: String = b.iter().map(|&c| c as char).collect();
                self.str(&text);
                self.str("latin1");
                self.out.push(op::TUPLE2);
                self.out.push(op::REDUCE);
            }
            Value::List(items) => {
                self.out.push(op::EMPTY_LIST);
                if !items.is_empty() {
                    self.out.push(op::MARK);
                    for it in items {
                        self.value(it, depth + 1)?;
                    }
                    self.out.push(op::APPENDS);
                }
            }
            Value::Tuple(items) => {
                self.out.push(op::MARK);
                for it in items {
                    self.value(it, depth + 1)?;
                }
                self.out.push(op::TUPLE);
            }
            Value::Dict(pairs) => {
                self.out.push(op::EMPTY_DICT);
                self.set_items(pairs, depth)?;
            }
            Value::OrderedDict { items, metadata } => {
                // As Python pickles one: OrderedDict() by REDUCE, the items by SETITEMS, then
                // BUILD with `{'_metadata': ...}` (set as an attribute).
                self.global("collections", "OrderedDict");
                self.out.push(op::EMPTY_TUPLE);
                self.out.push(op::REDUCE);
                self.set_items(items, depth)?;
                if let Some(m) = metadata {
                    self.out.push(op::EMPTY_DICT);
                    self.str("_metadata");
                    self.value(m, depth + 1)?;
                    self.out.push(op::SETITEM);
                    self.out.push(op::BUILD);
                }
            }
            Value::Tensor(t) => self.tensor(t)?,
        }
        Ok(())
    }
}
