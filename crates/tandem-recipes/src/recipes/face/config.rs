//! arcface_torch's Python config files (`configs/ms1mv3_r50.py` and the like) as settings:
//! `config.key = value` lines over `configs/base.py`'s defaults, mapped onto the recipes' option
//! keys (`batch_size`, `lr_scheduler`: each a `tandem train` flag with underscores).
//!
//! The files are read as data, never run: a line is a comment, blank, the `from easydict import
//! EasyDict as edict` preamble, `config = edict()`, or `config.key = expression` where the
//! expression is a literal (number, string, `True`/`False`/`None`, a tuple or list of literals)
//! or arithmetic (`+ - * / //`, parentheses) over literals and earlier `config.key` values
//! (arcface_torch writes `config.warmup_epoch = config.num_epoch // 10` and `30 * 10000`).
//! Anything else is refused naming the file and line. A small hand-written reader: a Python
//! parser crate would accept far more than this needs to, and running Python is out.
use std::collections::BTreeMap;
use std::fmt;
use std::path::{Path, PathBuf};

use tandem_train::{Result, TrainError};

/// A value of the config's expression language (serialised as the plain value it is: the
/// settings a TOML config would hold).
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
#[serde(untagged)]
pub enum PyValue {
    Int(i64),
    Float(f64),
    Str(String),
    Bool(bool),
    None,
    List(Vec<PyValue>),
}

impl fmt::Display for PyValue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PyValue::Int(i) => write!(f, "{i}"),
            PyValue::Float(x) => write!(f, "{x}"),
            PyValue::Str(s) => write!(f, "{s:?}"),
            PyValue::Bool(b) => f.write_str(if *b { "True" } else { "False" }),
            PyValue::None => f.write_str("None"),
            PyValue::List(items) => {
                let parts: Vec<String> = items.iter().map(ToString::to_string).collect();
                write!(f, "[{}]", parts.join(", "))
            }
        }
    }
}

/// `configs/base.py`'s values (insightface arcface_torch): what a job config starts from.
const BASE: &[(&str, &str)] = &[
    ("margin_list", "(1.0, 0.5, 0.0)"),
    ("network", "\"r50\""),
    ("resume", "False"),
    ("save_all_states", "False"),
    ("output", "\"ms1mv3_arcface_r50\""),
    ("embedding_size", "512"),
    ("sample_rate", "1"),
    ("interclass_filtering_threshold", "0"),
    ("fp16", "False"),
    ("batch_size", "128"),
    ("optimizer", "\"sgd\""),
    ("lr", "0.1"),
    ("momentum", "0.9"),
    ("weight_decay", "5e-4"),
    ("verbose", "2000"),
    ("frequent", "10"),
    ("dali", "False"),
    ("dali_aug", "False"),
    ("gradient_acc", "1"),
    ("seed", "2048"),
    ("num_workers", "2"),
    ("wandb_key", "\"XXXXXXXXXXXXXXXXXXXXXXXXXXXXXXXXXXXXXXXX\""),
    ("suffix_run_name", "None"),
    ("using_wandb", "False"),
    ("wandb_entity", "\"entity\""),
    ("wandb_project", "\"project\""),
    ("wandb_log_all", "True"),
    ("save_artifacts", "False"),
    ("wandb_resume", "False"),
];

/// Keys that only configure Weights & Biases logging: read, and ignored while `using_wandb` is
/// False.
/// A line or key of an arcface_torch config file that tandem does not read.
#[derive(Debug, thiserror::Error)]
pub enum PyConfigError {
    /// A line that is not `config.key = value` of literals, arithmetic and earlier keys.
    #[error("{}:{line}: `{text}`: {why}", path.display())]
    Line { path: PathBuf, line: usize, text: String, why: Box<ExprError> },
    /// A key whose value has no tandem setting.
    #[error("{}: config.{key} = {value}: {why}", path.display())]
    Key { path: PathBuf, key: String, value: String, why: String },
}

/// Why a line's right-hand side does not read.
#[derive(Debug, thiserror::Error)]
pub enum ExprError {
    #[error("only `config.key = value` assignments are read")]
    NotAnAssignment,
    #[error("unexpected `{0}`")]
    Unexpected(String),
    #[error("nested more than {MAX_DEPTH} deep")]
    TooDeep,
    #[error("expected `,` or `{close}` at `{at}`")]
    Separator { close: &'static str, at: String },
    #[error("unterminated string")]
    UnterminatedString,
    #[error("escapes in strings are not read")]
    Escapes,
    #[error("expected a value at `{0}`")]
    NoValue(String),
    #[error("bad number `{0}`")]
    BadNumber(String),
    #[error("`config.{0}` is not set above this line")]
    NotSetAbove(String),
    #[error("`{0}`: only literals and earlier config.key values are read")]
    NotLiteral(String),
    #[error("overflow")]
    Overflow,
    #[error("division by zero")]
    DivisionByZero,
    #[error("cannot apply `{op}` to {a} and {b}")]
    Operands { op: String, a: String, b: String },
}

type ExprResult<T> = std::result::Result<T, ExprError>;

impl From<PyConfigError> for TrainError {
    fn from(e: PyConfigError) -> Self {
        TrainError::Recipe(Box::new(e))
    }
}

const WANDB_KEYS: &[&str] =
    &["wandb_key", "wandb_entity", "wandb_project", "wandb_log_all", "suffix_run_name"];

/// The settings arcface_torch's config file at `path` means (see [`to_settings`]): the file
/// read as data ([`parse`]) over base.py's values ([`with_base`]).
pub fn read_settings(path: &Path) -> Result<Vec<(&'static str, PyValue)>> {
    let text = std::fs::read_to_string(path)?;
    to_settings(path, &with_base(path, parse(path, &text)?))
}

/// Reads a config file's assignments (without base.py's): key -> value, in file order.
pub fn parse(path: &Path, text: &str) -> Result<BTreeMap<String, PyValue>> {
    let mut values = BTreeMap::new();
    for (i, raw) in text.lines().enumerate() {
        let line = strip_comment(raw).trim();
        let at = |why| PyConfigError::Line {
            path: path.to_path_buf(),
            line: i + 1,
            text: raw.trim().to_string(),
            why: Box::new(why),
        };
        if line.is_empty()
            || line == "from easydict import EasyDict as edict"
            || line.replace(' ', "") == "config=edict()"
        {
            continue;
        }
        let Some((lhs, rhs)) = split_assignment(line) else {
            return Err(at(ExprError::NotAnAssignment).into());
        };
        let Some(key) = lhs.trim().strip_prefix("config.").filter(|k| is_identifier(k)) else {
            return Err(at(ExprError::NotAnAssignment).into());
        };
        let value = Expr::new(rhs, &values).parse().map_err(at)?;
        values.insert(key.to_string(), value);
    }
    Ok(values)
}

/// `base.py`'s values overlaid with the file's, as arcface_torch's `get_config` merges them
/// (`output` None becomes `work_dirs/NAME`).
pub fn with_base(path: &Path, file: BTreeMap<String, PyValue>) -> BTreeMap<String, PyValue> {
    let mut merged = BTreeMap::new();
    for (k, v) in BASE {
        let value = Expr::new(v, &merged).parse().expect("base.py's values are literals");
        merged.insert(k.to_string(), value);
    }
    merged.extend(file);
    if merged.get("output") == Some(&PyValue::None) {
        let stem = path.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default();
        merged.insert("output".into(), PyValue::Str(format!("work_dirs/{stem}")));
    }
    merged
}

/// The settings (option key, value) that a merged config means, as `train_v2.py` uses them: PolynomialLRWarmup with its warm-up and gradient
/// clipping at 5 always, the `.bin` verification sets next to the `.rec`.
pub fn to_settings(
    path: &Path,
    config: &BTreeMap<String, PyValue>,
) -> Result<Vec<(&'static str, PyValue)>> {
    let mut settings: Vec<(&'static str, PyValue)> = vec![
        ("lr_scheduler", PyValue::Str("polynomial-warmup".into())),
        ("clip_grad_norm", PyValue::Float(5.0)),
    ];
    let wandb = config.get("using_wandb") == Some(&PyValue::Bool(true));
    // The network first: a backbone tandem lacks is the first thing to hear about.
    let ordered = config.iter().filter(|(k, _)| *k == "network");
    for (key, value) in ordered.chain(config.iter().filter(|(k, _)| *k != "network")) {
        let bad = |why: &str| PyConfigError::Key {
            path: path.to_path_buf(),
            key: key.clone(),
            value: value.to_string(),
            why: why.to_string(),
        };
        let mut set = |key: &'static str, v: PyValue| settings.push((key, v));
        match key.as_str() {
            "network" => {
                let name = value.as_str().ok_or_else(|| bad("expected a string"))?;
                name.parse::<tandem_models::ModelKind>().map_err(|e| bad(&e.to_string()))?;
                set("model", PyValue::Str(name.into()));
            }
            "margin_list" => {
                let m = value.as_floats().filter(|m| m.len() == 3);
                let m = m.ok_or_else(|| bad("expected three numbers (m1, m2, m3)"))?;
                set("margin", PyValue::Str(format!("{},{},{}", m[0], m[1], m[2])));
            }
            "embedding_size" => set("embedding_size", value.as_uint(&bad)?),
            "sample_rate" => set("sample_rate", value.as_float(&bad)?),
            "interclass_filtering_threshold" => {
                set("interclass_filtering_threshold", value.as_float(&bad)?)
            }
            "fp16" => {
                let on = value.as_bool().ok_or_else(|| bad("expected True or False"))?;
                set("precision", PyValue::Str(if on { "f16" } else { "f32" }.into()));
            }
            "batch_size" => set("batch_size", value.as_uint(&bad)?),
            "optimizer" => match value.as_str() {
                Some(o @ ("sgd" | "adamw")) => set("optimizer", PyValue::Str(o.into())),
                _ => return Err(bad("arcface_torch's optimizers are \"sgd\" and \"adamw\"").into()),
            },
            "lr" => set("lr", value.as_float(&bad)?),
            "momentum" => set("momentum", value.as_float(&bad)?),
            "weight_decay" => set("weight_decay", value.as_float(&bad)?),
            "verbose" => set("verbose", value.as_uint(&bad)?),
            "num_epoch" => set("epochs", value.as_uint(&bad)?),
            "warmup_epoch" => set("warmup_epochs", value.as_uint(&bad)?),
            "num_classes" => set("num_classes", value.as_uint(&bad)?),
            "seed" => set("seed", value.as_uint(&bad)?),
            "num_workers" => set("num_workers", value.as_uint(&bad)?),
            "frequent" => set("log_every", value.as_uint(&bad)?),
            "resume" => {
                set("resume", PyValue::Bool(value.as_bool().ok_or_else(|| bad("expected a bool"))?))
            }
            "output" => set(
                "out",
                PyValue::Str(value.as_str().ok_or_else(|| bad("expected a path"))?.into()),
            ),
            "rec" => {
                let dir = value.as_str().ok_or_else(|| bad("expected a directory"))?;
                if dir == "synthetic" {
                    return Err(bad(
                        "arcface_torch's random-image dataset has no tandem counterpart; make a \
                         synthetic identity set with `tandem data synth-faces DIR` and name it",
                    )
                    .into());
                }
                set("data", PyValue::Str(format!("rec:{dir}")));
                if let Some(PyValue::List(names)) = config.get("val_targets") {
                    let files: std::result::Result<Vec<PyValue>, _> = names
                        .iter()
                        .map(|n| match n.as_str() {
                            Some(n) => Ok(PyValue::Str(format!("{dir}/{n}.bin"))),
                            None => Err(bad("val_targets must be names of .bin sets")),
                        })
                        .collect();
                    set("val", PyValue::List(files?));
                }
            }
            "gradient_acc" => set("gradient_acc", value.as_uint(&bad)?),
            // DALI is only arcface_torch's faster loader of the same .rec: tandem's own loader
            // reads it. Its extra augmentation is another matter.
            "dali" => {}
            "dali_aug" if value == &PyValue::Bool(false) => {}
            "dali_aug" => {
                return Err(bad("DALI's augmentation is not in tandem's loader (it flips)").into())
            }
            "using_wandb" if wandb => {
                return Err(bad("Weights & Biases logging is not in tandem (it writes \
                     metrics.jsonl and, with --tensorboard, TensorBoard events)")
                .into())
            }
            // Read and checked where they matter: the image count is the .rec's, every state
            // is always saved, W&B settings are not training options.
            "val_targets" | "num_image" | "save_all_states" | "using_wandb" | "save_artifacts"
            | "wandb_resume" => {}
            k if WANDB_KEYS.contains(&k) => {}
            _ => {
                return Err(bad(
                    "not one of arcface_torch's config keys (base.py and its configs/)",
                )
                .into())
            }
        }
    }
    Ok(settings)
}

impl PyValue {
    pub fn as_str(&self) -> Option<&str> {
        match self {
            PyValue::Str(s) => Some(s),
            _ => None,
        }
    }

    pub fn as_bool(&self) -> Option<bool> {
        match self {
            PyValue::Bool(b) => Some(*b),
            _ => None,
        }
    }

    pub fn as_f64(&self) -> Option<f64> {
        match self {
            PyValue::Int(i) => Some(*i as f64),
            PyValue::Float(x) => Some(*x),
            _ => None,
        }
    }

    fn as_floats(&self) -> Option<Vec<f64>> {
        match self {
            PyValue::List(items) => items.iter().map(PyValue::as_f64).collect(),
            _ => None,
        }
    }

    fn as_float(&self, bad: &dyn Fn(&str) -> PyConfigError) -> Result<PyValue, PyConfigError> {
        self.as_f64().map(PyValue::Float).ok_or_else(|| bad("expected a number"))
    }

    fn as_uint(&self, bad: &dyn Fn(&str) -> PyConfigError) -> Result<PyValue, PyConfigError> {
        match self {
            PyValue::Int(i) if *i >= 0 => Ok(PyValue::Int(*i)),
            _ => Err(bad("expected a whole number >= 0")),
        }
    }
}

/// The line without a trailing `# comment` (a `#` inside quotes stays).
fn strip_comment(line: &str) -> &str {
    let mut quote = None;
    for (i, c) in line.char_indices() {
        match (c, quote) {
            ('\'' | '"', None) => quote = Some(c),
            (q, Some(open)) if q == open => quote = None,
            ('#', None) => return &line[..i],
            _ => {}
        }
    }
    line
}

/// `lhs = rhs` at the first `=` that is not part of `==`, `<=`, `>=` or `!=`.
fn split_assignment(line: &str) -> Option<(&str, &str)> {
    let bytes = line.as_bytes();
    let i = (0..bytes.len()).find(|&i| {
        bytes[i] == b'='
            && bytes.get(i + 1) != Some(&b'=')
            && (i == 0 || !matches!(bytes[i - 1], b'=' | b'<' | b'>' | b'!'))
    })?;
    Some((&line[..i], &line[i + 1..]))
}

fn is_identifier(s: &str) -> bool {
    let mut chars = s.chars();
    chars.next().is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
}

/// A recursive-descent reader of one right-hand side.
struct Expr<'a> {
    text: &'a str,
    pos: usize,
    known: &'a BTreeMap<String, PyValue>,
    /// Nesting of brackets and unary minus so far (bounded: the reader recurses).
    depth: usize,
}

/// Deeper nesting than any config writes is refused (the reader recurses per level).
const MAX_DEPTH: usize = 32;

impl<'a> Expr<'a> {
    fn new(text: &'a str, known: &'a BTreeMap<String, PyValue>) -> Self {
        Expr { text, pos: 0, known, depth: 0 }
    }

    fn parse(mut self) -> ExprResult<PyValue> {
        let v = self.sum()?;
        self.skip_space();
        if self.pos != self.text.len() {
            return Err(ExprError::Unexpected(self.text[self.pos..].into()));
        }
        Ok(v)
    }

    fn skip_space(&mut self) {
        while self.rest().starts_with([' ', '\t']) {
            self.pos += 1;
        }
    }

    fn rest(&self) -> &'a str {
        &self.text[self.pos..]
    }

    fn eat(&mut self, token: &str) -> bool {
        self.skip_space();
        if self.rest().starts_with(token) {
            self.pos += token.len();
            true
        } else {
            false
        }
    }

    fn sum(&mut self) -> ExprResult<PyValue> {
        let mut v = self.product()?;
        loop {
            if self.eat("+") {
                v = arith(&v, &self.product()?, '+')?;
            } else if self.eat("-") {
                v = arith(&v, &self.product()?, '-')?;
            } else {
                return Ok(v);
            }
        }
    }

    fn product(&mut self) -> ExprResult<PyValue> {
        let mut v = self.unary()?;
        loop {
            if self.eat("//") {
                v = arith(&v, &self.unary()?, 'f')?;
            } else if self.eat("*") {
                v = arith(&v, &self.unary()?, '*')?;
            } else if self.eat("/") {
                v = arith(&v, &self.unary()?, '/')?;
            } else {
                return Ok(v);
            }
        }
    }

    fn nest<T>(&mut self, f: impl FnOnce(&mut Self) -> ExprResult<T>) -> ExprResult<T> {
        if self.depth >= MAX_DEPTH {
            return Err(ExprError::TooDeep);
        }
        self.depth += 1;
        let out = f(self);
        self.depth -= 1;
        out
    }

    fn unary(&mut self) -> ExprResult<PyValue> {
        if self.eat("-") {
            let v = self.nest(Self::unary)?;
            return arith(&PyValue::Int(0), &v, '-');
        }
        self.atom()
    }

    fn atom(&mut self) -> ExprResult<PyValue> {
        self.skip_space();
        let rest = self.rest();
        if self.eat("(") || self.eat("[") {
            let close = if rest.starts_with('(') { ")" } else { "]" };
            let mut items = Vec::new();
            let mut trailing_comma = false;
            while !self.eat(close) {
                items.push(self.nest(Self::sum)?);
                trailing_comma = self.eat(",");
                if !trailing_comma && !self.eat(close) {
                    return Err(ExprError::Separator { close, at: self.rest().into() });
                } else if !trailing_comma {
                    break;
                }
            }
            // `(x)` is x; `(x,)`, `[x]` and anything with two items are sequences.
            if close == ")" && items.len() == 1 && !trailing_comma {
                return Ok(items.remove(0));
            }
            return Ok(PyValue::List(items));
        }
        if let Some(q) = rest.chars().next().filter(|c| *c == '"' || *c == '\'') {
            let body = &rest[1..];
            let Some(end) = body.find(q) else { return Err(ExprError::UnterminatedString) };
            if body[..end].contains('\\') {
                return Err(ExprError::Escapes);
            }
            self.pos += end + 2;
            return Ok(PyValue::Str(body[..end].to_string()));
        }
        let len = rest
            .find(|c: char| !(c.is_ascii_alphanumeric() || matches!(c, '_' | '.')))
            .unwrap_or(rest.len());
        // A float's exponent sign (`5e-4`) belongs to the number.
        let mut len = len;
        if rest[..len].ends_with(['e', 'E'])
            && rest[..len].starts_with(|c: char| c.is_ascii_digit() || c == '.')
            && rest[len..].starts_with(['-', '+'])
        {
            let tail = &rest[len + 1..];
            len += 1 + tail.find(|c: char| !c.is_ascii_digit()).unwrap_or(tail.len());
        }
        let word = &rest[..len];
        self.pos += len;
        match word {
            "" => Err(ExprError::NoValue(rest.into())),
            "True" => Ok(PyValue::Bool(true)),
            "False" => Ok(PyValue::Bool(false)),
            "None" => Ok(PyValue::None),
            w if w.starts_with(|c: char| c.is_ascii_digit() || c == '.') => {
                let w = w.replace('_', "");
                if let Ok(i) = w.parse::<i64>() {
                    Ok(PyValue::Int(i))
                } else {
                    w.parse::<f64>()
                        .map(PyValue::Float)
                        .map_err(|_| ExprError::BadNumber(w.clone()))
                }
            }
            w => match w.strip_prefix("config.") {
                Some(k) => {
                    self.known.get(k).cloned().ok_or_else(|| ExprError::NotSetAbove(k.into()))
                }
                None => Err(ExprError::NotLiteral(w.into())),
            },
        }
    }
}

/// Python's `+ - * / //` on ints and floats (`f`: floor division).
fn arith(a: &PyValue, b: &PyValue, op: char) -> ExprResult<PyValue> {
    use PyValue::{Float, Int, Str};
    Ok(match (a, b) {
        (Int(x), Int(y)) => match op {
            '+' => Int(x.checked_add(*y).ok_or(ExprError::Overflow)?),
            '-' => Int(x.checked_sub(*y).ok_or(ExprError::Overflow)?),
            '*' => Int(x.checked_mul(*y).ok_or(ExprError::Overflow)?),
            'f' if *y != 0 => {
                // Python's floor division: Euclid's quotient, one less for a negative divisor
                // that leaves a remainder.
                let (q, r) = (x.checked_div_euclid(*y), x.checked_rem_euclid(*y));
                let (q, r) = q.zip(r).ok_or(ExprError::Overflow)?;
                Int(q - i64::from(*y < 0 && r != 0))
            }
            '/' if *y != 0 => Float(*x as f64 / *y as f64),
            _ => return Err(ExprError::DivisionByZero),
        },
        (Int(_) | Float(_), Int(_) | Float(_)) => {
            let (x, y) = (a.as_f64().unwrap_or(0.0), b.as_f64().unwrap_or(0.0));
            match op {
                '+' => Float(x + y),
                '-' => Float(x - y),
                '*' => Float(x * y),
                'f' if y != 0.0 => Float((x / y).floor()),
                '/' if y != 0.0 => Float(x / y),
                _ => return Err(ExprError::DivisionByZero),
            }
        }
        (Str(x), Str(y)) if op == '+' => Str(format!("{x}{y}")),
        _ => {
            let op = if op == 'f' { "//".to_string() } else { op.to_string() };
            return Err(ExprError::Operands { op, a: a.to_string(), b: b.to_string() });
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read(text: &str) -> Result<BTreeMap<String, PyValue>> {
        parse(Path::new("configs/x.py"), text)
    }

    #[test]
    fn literals_and_arithmetic_as_python_reads_them() {
        let v = read(
            "from easydict import EasyDict as edict\nconfig = edict()\n\
             config.a = 5e-4 # comment\nconfig.b = (1.0, 0.5, 0.0)\nconfig.c = ['lfw', \"x#y\"]\n\
             config.num_epoch = 40\nconfig.d = config.num_epoch // 10\nconfig.e = 30 * 10000\n\
             config.f = -7 // 2\nconfig.g = 7 / 2\nconfig.h = None\nconfig.i = True\n\
             config.j = []\nconfig.k = (3)\n",
        )
        .unwrap();
        assert_eq!(v["a"], PyValue::Float(5e-4));
        assert_eq!(
            v["b"],
            PyValue::List(vec![PyValue::Float(1.0), PyValue::Float(0.5), PyValue::Float(0.0)])
        );
        assert_eq!(
            v["c"],
            PyValue::List(vec![PyValue::Str("lfw".into()), PyValue::Str("x#y".into())])
        );
        assert_eq!(v["d"], PyValue::Int(4));
        assert_eq!(v["e"], PyValue::Int(300_000));
        assert_eq!(v["f"], PyValue::Int(-4), "floor division rounds down");
        assert_eq!(v["g"], PyValue::Float(3.5));
        assert_eq!(
            (&v["h"], &v["i"], &v["j"], &v["k"]),
            (&PyValue::None, &PyValue::Bool(true), &PyValue::List(vec![]), &PyValue::Int(3))
        );
    }

    fn json_value(v: &PyValue) -> serde_json::Value {
        match v {
            PyValue::Int(i) => (*i).into(),
            PyValue::Float(x) => (*x).into(),
            PyValue::Str(s) => s.as_str().into(),
            PyValue::Bool(b) => (*b).into(),
            PyValue::None => serde_json::Value::Null,
            PyValue::List(items) => items.iter().map(json_value).collect(),
        }
    }

    /// Every config of arcface_torch's configs/ folder (tests/fixtures/arcface_configs) reads
    /// to what Python itself makes of it (make_expected.py), key for key, base.py merged; and
    /// each maps onto tandem's flags but those on random images or with DALI's augmentation.
    #[test]
    fn every_arcface_torch_config_reads_as_python_reads_it() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/arcface_configs");
        let text = std::fs::read_to_string(dir.join("expected.json")).unwrap();
        let expected: BTreeMap<String, serde_json::Value> = serde_json::from_str(&text).unwrap();
        assert_eq!(expected.len(), 42);
        let (mut mapped, mut refused) = (0, 0);
        for (name, want) in &expected {
            let path = dir.join(name);
            let read = parse(&path, &std::fs::read_to_string(&path).unwrap()).unwrap();
            let merged = with_base(Path::new(name), read);
            let got: serde_json::Map<String, serde_json::Value> =
                merged.iter().map(|(k, v)| (k.clone(), json_value(v))).collect();
            assert_eq!(&serde_json::Value::Object(got), want, "{name}");
            match to_settings(&path, &merged) {
                Ok(settings) => {
                    mapped += 1;
                    let setting =
                        |f: &str| settings.iter().find(|(k, _)| *k == f).map(|(_, v)| v.clone());
                    let batch = want["batch_size"].as_i64().unwrap();
                    assert_eq!(setting("batch_size"), Some(PyValue::Int(batch)));
                    let poly = PyValue::Str("polynomial-warmup".into());
                    assert_eq!(setting("lr_scheduler"), Some(poly), "{name}");
                    let rec = want["rec"].as_str().unwrap();
                    let data = PyValue::Str(format!("rec:{rec}"));
                    assert_eq!(setting("data"), Some(data), "{name}");
                    let vals = want["val_targets"].as_array().unwrap().len();
                    let listed = |v: PyValue| match v {
                        PyValue::List(items) => items.len(),
                        other => panic!("{name}: val = {other}"),
                    };
                    assert_eq!(setting("val").map(listed), Some(vals));
                }
                Err(e) => {
                    let e = e.to_string();
                    assert!(
                        e.contains("DALI") && want["dali_aug"] == true
                            || e.contains("synthetic") && want["rec"] == "synthetic",
                        "{name}: {e}"
                    );
                    refused += 1;
                }
            }
        }
        assert!(
            mapped >= 39 && mapped + refused == expected.len(),
            "{mapped} configs map onto the recipe's options; {refused} use DALI's augmentation \
             or random images"
        );
    }

    #[test]
    fn a_config_maps_onto_the_recipe_s_options() {
        let path = Path::new("configs/wf4m_mbf.py");
        let read = read(
            "config.network = \"mbf\"\nconfig.margin_list = (1.0, 0.0, 0.4)\n\
             config.fp16 = True\nconfig.optimizer = \"adamw\"\nconfig.lr = 1e-3\n\
             config.rec = \"/data/WebFace4M\"\nconfig.num_epoch = 20\n\
             config.warmup_epoch = config.num_epoch // 10\nconfig.val_targets = ['lfw']\n\
             config.output = None\n",
        )
        .unwrap();
        let settings: BTreeMap<&str, PyValue> =
            to_settings(path, &with_base(path, read)).unwrap().into_iter().collect();
        let text = |s: &str| PyValue::Str(s.into());
        let want: [(&str, PyValue); 12] = [
            ("model", text("mbf")),
            ("margin", text("1,0,0.4")),
            ("precision", text("f16")),
            ("optimizer", text("adamw")),
            ("lr", PyValue::Float(1e-3)),
            ("epochs", PyValue::Int(20)),
            ("warmup_epochs", PyValue::Int(2)),
            ("data", text("rec:/data/WebFace4M")),
            ("val", PyValue::List(vec![text("/data/WebFace4M/lfw.bin")])),
            ("out", text("work_dirs/wf4m_mbf")),
            ("clip_grad_norm", PyValue::Float(5.0)),
            ("seed", PyValue::Int(2048)),
        ];
        for (k, v) in want {
            assert_eq!(settings.get(k), Some(&v), "{k}");
        }
        let acc = read_ok("config.network = \"vit_b_dp005_mask_005\"\nconfig.gradient_acc = 12\n");
        let settings: BTreeMap<&str, PyValue> =
            to_settings(path, &with_base(path, acc)).unwrap().into_iter().collect();
        assert_eq!(settings.get("gradient_acc"), Some(&PyValue::Int(12)));
        assert_eq!(settings.get("model"), Some(&text("vit_b_dp005_mask_005")));
        for (text, why) in [
            ("config.dali_aug = True\n", "DALI"),
            ("config.lr_typo = 1\n", "not one of"),
            ("config.network = \"r152\"\n", "unknown model"),
        ] {
            let e = to_settings(path, &with_base(path, read_ok(text))).unwrap_err().to_string();
            assert!(e.contains(why) && e.contains("wf4m_mbf.py"), "{text}: {e}");
        }
    }

    fn read_ok(text: &str) -> BTreeMap<String, PyValue> {
        read(text).unwrap()
    }

    #[test]
    fn anything_but_plain_assignments_is_refused_naming_the_line() {
        for (text, line) in [
            ("config = edict()\nimport os\n", 2),
            ("config.a = 1\nconfig.b = os.getcwd()\n", 2),
            ("config.a = open('x')\n", 1),
            ("config.a = config.missing + 1\n", 1),
            ("x = 3\n", 1),
            ("config.a = 1 if True else 2\n", 1),
            ("config.a = \"unterminated\n", 1),
            ("config.a = 1\nconfig.b = ((((((((((((((((((((((((((((((((((1))))))))))))))))))))))))))))))))))\n", 2),
            ("config.a = ----------------------------------------1\n", 1),
            ("config.a = 9223372036854775807 * 2\n", 1),
            ("config.a = 1 // 0\n", 1),
            ("config.a = -9223372036854775807 - 1\nconfig.b = config.a // -1\n", 2),
            ("for i in range(3): config.a = i\n", 1),
        ] {
            let e = read(text).unwrap_err().chain_text();
            assert!(e.contains(&format!("configs/x.py:{line}:")), "{text:?}: {e}");
        }
    }
}
