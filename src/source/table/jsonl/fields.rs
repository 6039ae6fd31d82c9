//! Which fields a data set of JSON lines reads, and how: what the first lines show of each
//! key ([`Inference`]), the type that makes of it ([`decide`]), the fields the options
//! choose ([`Plan::new`]: names, declarations, fill values), and the walk of a line that
//! reads them, skipping every other key ([`Plan::read_line`]).

use std::collections::HashMap;

use super::JsonLinesOptions;
use super::parse::{Cursor, Fault, MAX_DEPTH, Step, Wrong, align, list, tensor, unescape};
use crate::error::{Error, Result};
use crate::format::{Codec, DType};
use crate::source::FieldSpan;
use crate::source::shards::FieldDecode;

/// What a field's values are read as.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Kind {
    /// Numbers (or bools), nested in lists of this shape.
    Tensor { dtype: DType, shape: Vec<u64> },
    /// A string's text.
    Text,
    /// The value's text as written.
    Json,
    /// A list of numbers (or bools), any count.
    List(DType),
}

impl Kind {
    fn of(decode: &FieldDecode) -> std::result::Result<Kind, String> {
        Ok(match decode {
            FieldDecode::Int => Kind::Tensor {
                dtype: DType::I64,
                shape: Vec::new(),
            },
            FieldDecode::Float => Kind::Tensor {
                dtype: DType::F64,
                shape: Vec::new(),
            },
            FieldDecode::Tensor { dtype, shape } => Kind::Tensor {
                dtype: *dtype,
                shape: shape.clone(),
            },
            FieldDecode::Bytes(Codec::Utf8 | Codec::Raw) => Kind::Text,
            FieldDecode::Bytes(Codec::Json) => Kind::Json,
            FieldDecode::Bytes(Codec::Elements(dtype)) => Kind::List(*dtype),
            other => {
                return Err(format!(
                    "`{other}` is not read from JSON: a string is utf8 or raw, any value's text json, a number int, float or a tensor (f32[], f32[3]), a list of numbers list[i64] (list[f32], ...)"
                ));
            }
        })
    }

    /// The alignment of its decoded values.
    fn align(&self) -> usize {
        match self {
            Kind::Tensor { dtype, .. } | Kind::List(dtype) => dtype.size(),
            Kind::Text | Kind::Json => 1,
        }
    }
}

/// Kinds of value a key held, as bits.
mod seen {
    pub const NULL: u8 = 1;
    pub const BOOL: u8 = 2;
    pub const INT: u8 = 4;
    pub const FLOAT: u8 = 8;
    pub const STR: u8 = 16;
    pub const LIST: u8 = 32;
    pub const OBJECT: u8 = 64;
}

/// What one key (at one place: `a.b`) held in the first lines.
#[derive(Clone, Debug, Default)]
struct Seen {
    /// Its keys from the top, and their name (joined with `.`).
    path: Vec<String>,
    /// The kinds of its values ([`seen`]).
    kinds: u8,
    /// The kinds of the items of its lists.
    items: u8,
    /// Another key of the same name (`a.b` both a key and `b` in `a`).
    ambiguous: bool,
}

/// What the first lines show: every key, in the order first seen.
#[derive(Default)]
pub(super) struct Inference {
    keys: Vec<Seen>,
    by_name: HashMap<String, usize>,
}

impl Inference {
    fn note(&mut self, path: &[String], kinds: u8, items: u8) {
        let name = path.join(".");
        let k = *self.by_name.entry(name).or_insert_with(|| {
            self.keys.push(Seen {
                path: path.to_vec(),
                ..Seen::default()
            });
            self.keys.len() - 1
        });
        let s = &mut self.keys[k];
        s.kinds |= kinds;
        s.items |= items;
        if s.path != path {
            s.ambiguous = true;
        }
    }

    /// Walks the object at the cursor, noting each key under `path`.
    pub(super) fn observe_object(
        &mut self,
        c: &mut Cursor<'_>,
        path: &mut Vec<String>,
        depth: usize,
    ) -> Step<()> {
        if depth > MAX_DEPTH {
            return Err(c.fault(format!("values nested more than {MAX_DEPTH} deep")));
        }
        if !c.eat(b'{') {
            return Err(c.expected("`{`"));
        }
        c.ws();
        if c.eat(b'}') {
            return Ok(());
        }
        loop {
            let key_at = c.at;
            let (raw, escaped) = c.key()?;
            let key = if escaped {
                let mut k = Vec::new();
                unescape(&c.b[raw.clone()], raw.start, &mut k)?;
                String::from_utf8(k).map_err(|_| Fault {
                    at: key_at,
                    what: "a key that is not UTF-8 text".into(),
                })?
            } else {
                // The line was checked to be UTF-8; a string's raw bytes end at a quote.
                String::from_utf8_lossy(&c.b[raw]).into_owned()
            };
            path.push(key);
            match c.peek() {
                Some(b'{') => {
                    self.note(path, seen::OBJECT, 0);
                    self.observe_object(c, path, depth + 1)?;
                }
                Some(b'[') => {
                    let items = Self::list_items(c, depth + 1)?;
                    self.note(path, seen::LIST, items);
                }
                _ => {
                    let kind = Self::scalar(c)?;
                    self.note(path, kind, 0);
                }
            }
            path.pop();
            if !c.after_member()? {
                return Ok(());
            }
        }
    }

    /// The kind of the scalar at the cursor, read past it.
    fn scalar(c: &mut Cursor<'_>) -> Step<u8> {
        Ok(match c.peek() {
            Some(b'"') => {
                c.string()?;
                seen::STR
            }
            Some(b't') => {
                c.literal(b"true")?;
                seen::BOOL
            }
            Some(b'f') => {
                c.literal(b"false")?;
                seen::BOOL
            }
            Some(b'n') => {
                c.literal(b"null")?;
                seen::NULL
            }
            _ => {
                if c.number()?.int {
                    seen::INT
                } else {
                    seen::FLOAT
                }
            }
        })
    }

    /// The kinds of the items of the list at the cursor, read past it.
    fn list_items(c: &mut Cursor<'_>, depth: usize) -> Step<u8> {
        c.at += 1;
        c.ws();
        let mut items = 0;
        if c.eat(b']') {
            return Ok(0);
        }
        loop {
            items |= match c.peek() {
                Some(b'{') => {
                    c.skip(depth + 1)?;
                    seen::OBJECT
                }
                Some(b'[') => {
                    c.skip(depth + 1)?;
                    seen::LIST
                }
                _ => Self::scalar(c)?,
            };
            if !c.after_item()? {
                return Ok(items);
            }
        }
    }
}

/// How the values a key held in the first `lines` lines are read, or why they cannot be.
fn decide(s: &Seen, lines: u64) -> std::result::Result<FieldDecode, String> {
    use seen::*;
    if s.ambiguous {
        return Err("a key of this name with a `.` in it and a key of an inner object both have this name: name one of them in fields".into());
    }
    let k = s.kinds & !NULL;
    let words = |bits: u8| -> String {
        let names = [
            (BOOL, "bools"),
            (INT, "integers"),
            (FLOAT, "numbers"),
            (STR, "strings"),
            (LIST, "lists"),
            (OBJECT, "objects"),
            (NULL, "nulls"),
        ];
        let v: Vec<&str> = names
            .iter()
            .filter(|(b, _)| bits & b != 0)
            .map(|(_, n)| *n)
            .collect();
        v.join(" and ")
    };
    match k {
        0 => Err(format!(
            "null in every line of the first {lines} that has it: declare its type"
        )),
        STR => Ok(FieldDecode::Bytes(Codec::Utf8)),
        BOOL => Ok(FieldDecode::Tensor {
            dtype: DType::Bool,
            shape: Vec::new(),
        }),
        INT => Ok(FieldDecode::Int),
        FLOAT => Ok(FieldDecode::Float),
        _ if k == INT | FLOAT => Ok(FieldDecode::Float),
        LIST => {
            let items = s.items;
            let list = |d| Ok(FieldDecode::Bytes(Codec::Elements(d)));
            match items {
                0 => Err(format!(
                    "an empty list in every line of the first {lines}: declare its type (list[i64], say)"
                )),
                INT => list(DType::I64),
                FLOAT => list(DType::F64),
                _ if items == INT | FLOAT => list(DType::F64),
                BOOL => list(DType::Bool),
                _ if items & LIST != 0 && items & !(LIST) == 0 => Err(
                    "lists of lists: declare it a tensor of their shape (f32[2,3], say), or json for its text".into(),
                ),
                _ => Err(format!(
                    "lists of {}: declare it json to read each list's text",
                    words(items)
                )),
            }
        }
        _ => Err(format!(
            "{} in the first {lines} lines: declare its type",
            words(k)
        )),
    }
}

/// A value for the lines where a field is missing or null, decoded once.
#[derive(Clone, Debug)]
pub(super) struct Fill {
    pub(super) text: String,
    pub(super) bytes: Vec<u8>,
    pub(super) align: usize,
}

/// One field read from each line.
#[derive(Clone, Debug)]
pub(super) struct PlannedField {
    pub(super) name: String,
    pub(super) decode: FieldDecode,
    kind: Kind,
    pub(super) declared: bool,
    pub(super) fill: Option<Fill>,
}

/// Where a key leads: a field, or an inner object holding fields.
#[derive(Debug)]
enum Slot {
    Field(usize),
    Object(Node),
}

/// The keys of one object that lead to fields.
#[derive(Debug, Default)]
struct Node {
    keys: Vec<(Box<[u8]>, Slot)>,
}

impl Node {
    fn find(&self, key: &[u8]) -> Option<&Slot> {
        self.keys
            .iter()
            .find(|(k, _)| **k == *key)
            .map(|(_, slot)| slot)
    }

    /// Adds field `k` at `path`; a field inside another is refused.
    fn insert(&mut self, path: &[String], k: usize) -> std::result::Result<(), ()> {
        let Some((first, rest)) = path.split_first() else {
            return Err(());
        };
        let key = first.as_bytes();
        let at = self.keys.iter().position(|(x, _)| **x == *key);
        match (at, rest.is_empty()) {
            (None, true) => self.keys.push((key.into(), Slot::Field(k))),
            (None, false) => {
                let mut node = Node::default();
                node.insert(rest, k)?;
                self.keys.push((key.into(), Slot::Object(node)));
            }
            (Some(i), false) => match &mut self.keys[i].1 {
                Slot::Object(node) => node.insert(rest, k)?,
                Slot::Field(_) => return Err(()),
            },
            (Some(_), true) => return Err(()),
        }
        Ok(())
    }

    /// Every field under this node.
    fn each_field(&self, f: &mut dyn FnMut(usize)) {
        for (_, slot) in &self.keys {
            match slot {
                Slot::Field(k) => f(*k),
                Slot::Object(node) => node.each_field(f),
            }
        }
    }
}

/// What a line gave a field.
#[derive(Clone, Debug)]
pub(super) enum Got {
    Missing,
    /// `null`, at this byte.
    Null(usize),
    At(FieldSpan),
}

/// The fields read from each line and how.
#[derive(Debug, Default)]
pub(super) struct Plan {
    pub(super) fields: Vec<PlannedField>,
    tree: Node,
}

/// Keys the first lines show that no field reads, each with why.
pub(super) type LeftOut = Vec<(String, String)>;

/// A field chosen to be read: its name, its keys from the top, how it is read, and whether
/// that was declared.
struct Chosen {
    name: String,
    path: Vec<String>,
    decode: FieldDecode,
    declared: bool,
}

/// True if `name` is inside the object `parent` (`parent.x`, `parent.x.y`).
fn is_inside(name: &str, parent: &str) -> bool {
    name.len() > parent.len() && name.starts_with(parent) && name.as_bytes()[parent.len()] == b'.'
}

impl Seen {
    fn name(&self) -> String {
        self.path.join(".")
    }

    /// True for a key that held objects (or null) only: its keys are the fields.
    fn is_object(&self) -> bool {
        self.kinds & !seen::NULL == seen::OBJECT
    }
}

impl Inference {
    fn named(&self, name: &str) -> Option<&Seen> {
        self.by_name.get(name).map(|&k| &self.keys[k])
    }

    /// A field's keys from the top: those seen, else its name cut at each `.`.
    fn path_of(&self, name: &str) -> Vec<String> {
        match self.named(name) {
            Some(s) => s.path.clone(),
            None => name.split('.').map(str::to_string).collect(),
        }
    }
}

/// The fields `options` choose from what the first `lines` lines showed, and the keys left
/// out (with why).
fn select(
    inference: &Inference,
    lines: u64,
    options: &JsonLinesOptions,
) -> Result<(Vec<Chosen>, LeftOut)> {
    let mut chosen = Vec::new();
    let mut left_out = Vec::new();
    match &options.fields {
        Some(names) => {
            for name in names {
                select_named(inference, lines, options, name, &mut chosen)?;
            }
        }
        None => select_all(inference, lines, options, &mut chosen, &mut left_out),
    }
    if let Some(name) = options
        .decode
        .keys()
        .find(|name| !chosen.iter().any(|c| c.name == **name))
    {
        return Err(Error::config(
            "decode",
            format!("`{name}` is declared but not among the fields read"),
        ));
    }
    if chosen.is_empty() {
        let why: Vec<String> = left_out
            .iter()
            .map(|(n, why)| format!("`{n}`: {why}"))
            .collect();
        return Err(Error::config(
            "fields",
            format!(
                "no field to read: the first {lines} lines have none that can be read ({}); declare one",
                why.join("; ")
            ),
        ));
    }
    Ok((chosen, left_out))
}

/// The field (or the fields inside the object) `name`, asked for by name.
fn select_named(
    inference: &Inference,
    lines: u64,
    options: &JsonLinesOptions,
    name: &str,
    chosen: &mut Vec<Chosen>,
) -> Result<()> {
    let declared = |name: &str| {
        options.decode.get(name).map(|d| Chosen {
            name: name.to_string(),
            path: inference.path_of(name),
            decode: d.clone(),
            declared: true,
        })
    };
    let inferred = |s: &Seen, within: &str| -> Result<Chosen> {
        let decode = decide(s, lines).map_err(|why| {
            Error::config("fields", format!("field `{}`{within}: {why}", s.name()))
        })?;
        Ok(Chosen {
            name: s.name(),
            path: s.path.clone(),
            decode,
            declared: false,
        })
    };
    if let Some(c) = declared(name) {
        chosen.push(c);
        return Ok(());
    }
    match inference.named(name) {
        Some(s) if !s.is_object() => chosen.push(inferred(s, "")?),
        Some(_) => {
            let within = format!(" (in `{name}`)");
            for s in inference.keys.iter().filter(|s| !s.is_object()) {
                let n = s.name();
                if is_inside(&n, name) && !options.decode.contains_key(&n) {
                    chosen.push(inferred(s, &within)?);
                }
            }
            for n in options.decode.keys().filter(|n| is_inside(n, name)) {
                chosen.extend(declared(n));
            }
        }
        None => {
            let names: Vec<String> = inference
                .keys
                .iter()
                .filter(|s| !s.is_object())
                .take(32)
                .map(Seen::name)
                .collect();
            return Err(Error::config(
                "fields",
                format!(
                    "no field `{name}` in the first {lines} lines (their fields: {names:?}); declare its type to read it from later lines"
                ),
            ));
        }
    }
    Ok(())
}

/// Every field the first lines show that can be read, and every one declared; the others
/// into `left_out`.
fn select_all(
    inference: &Inference,
    lines: u64,
    options: &JsonLinesOptions,
    chosen: &mut Vec<Chosen>,
    left_out: &mut LeftOut,
) {
    // Objects declared as one field (`json`): their keys are not fields.
    let declared_objects: Vec<&String> = options
        .decode
        .keys()
        .filter(|d| inference.named(d).is_some_and(Seen::is_object))
        .collect();
    for s in &inference.keys {
        let name = s.name();
        if let Some(d) = options.decode.get(&name) {
            chosen.push(Chosen {
                name,
                path: s.path.clone(),
                decode: d.clone(),
                declared: true,
            });
            continue;
        }
        if s.is_object() || declared_objects.iter().any(|d| is_inside(&name, d)) {
            continue;
        }
        match decide(s, lines) {
            Ok(decode) => chosen.push(Chosen {
                name,
                path: s.path.clone(),
                decode,
                declared: false,
            }),
            Err(why) => left_out.push((name, why)),
        }
    }
    for (name, d) in &options.decode {
        if !chosen.iter().any(|c| c.name == *name) {
            chosen.push(Chosen {
                name: name.clone(),
                path: inference.path_of(name),
                decode: d.clone(),
                declared: true,
            });
        }
    }
    // An empty object in every line: nothing in it to read.
    for s in inference.keys.iter().filter(|s| s.is_object()) {
        let name = s.name();
        let inside = |n: &str| n == name || is_inside(n, &name);
        if !chosen.iter().any(|c| inside(&c.name)) && !left_out.iter().any(|(n, _)| inside(n)) {
            left_out.push((
                name,
                format!("an empty object in every line of the first {lines}"),
            ));
        }
    }
}

impl Plan {
    /// The fields `options` ask for, from what the first `lines` lines showed, with their
    /// fill values; and the keys left out, with why.
    pub(super) fn new(
        inference: &Inference,
        lines: u64,
        options: &JsonLinesOptions,
    ) -> Result<(Plan, LeftOut)> {
        let (chosen, left_out) = select(inference, lines, options)?;
        let mut plan = Plan::default();
        for c in chosen {
            let name = c.name;
            let kind = Kind::of(&c.decode)
                .map_err(|why| Error::config("decode", format!("field `{name}`: {why}")))?;
            if plan.fields.iter().any(|f| f.name == name) {
                return Err(Error::config(
                    "fields",
                    format!("field `{name}` is asked for twice"),
                ));
            }
            plan.tree.insert(&c.path, plan.fields.len()).map_err(|()| {
                Error::config(
                    "fields",
                    format!(
                        "field `{name}` is inside another field read (an object read whole as json, say): read one of them"
                    ),
                )
            })?;
            plan.fields.push(PlannedField {
                name,
                decode: c.decode,
                kind,
                declared: c.declared,
                fill: None,
            });
        }
        for (name, text) in &options.fill {
            let Some(k) = plan.fields.iter().position(|f| f.name == *name) else {
                return Err(Error::config(
                    "fill",
                    format!("`{name}` has a fill value but is not among the fields read"),
                ));
            };
            let fill = plan.fill(k, text).map_err(|why| {
                Error::config(
                    "fill",
                    format!("the fill value of `{name}` ({text}): {why}"),
                )
            })?;
            plan.fields[k].fill = Some(fill);
        }
        Ok((plan, left_out))
    }

    /// Field `k`'s fill value, from its JSON `text`.
    fn fill(&self, k: usize, text: &str) -> std::result::Result<Fill, String> {
        let b = text.as_bytes();
        let mut c = Cursor::new(b);
        c.ws();
        let mut decoded = Vec::new();
        let got = self.value(&mut c, k, &mut decoded, 0).map_err(|f| f.what)?;
        c.ws();
        c.end()
            .map_err(|_| "more than one JSON value".to_string())?;
        let bytes = match got {
            Got::At(FieldSpan::Shared(r)) => b[r].to_vec(),
            Got::At(FieldSpan::Decoded(r)) => decoded[r].to_vec(),
            Got::Null(_) | Got::Missing => return Err("a fill value cannot be null".into()),
        };
        Ok(Fill {
            text: text.to_string(),
            bytes,
            align: self.fields[k].kind.align(),
        })
    }

    /// Reads `line` (one object and whitespace) into `got`, decoded values into `decoded`.
    pub(super) fn read_line(
        &self,
        line: &[u8],
        got: &mut [Got],
        decoded: &mut Vec<u8>,
    ) -> Step<()> {
        let mut c = Cursor::new(line);
        c.ws();
        if c.peek() != Some(b'{') {
            return Err(c.expected("`{`"));
        }
        self.object(&mut c, &self.tree, got, decoded, 0)?;
        c.ws();
        c.end()
    }

    /// The object at the cursor: its keys that lead to fields read into `got`, the others
    /// skipped.
    fn object(
        &self,
        c: &mut Cursor<'_>,
        node: &Node,
        got: &mut [Got],
        decoded: &mut Vec<u8>,
        depth: usize,
    ) -> Step<()> {
        if depth > MAX_DEPTH {
            return Err(c.fault(format!("values nested more than {MAX_DEPTH} deep")));
        }
        c.at += 1;
        c.ws();
        if c.eat(b'}') {
            return Ok(());
        }
        let mut key_buf = Vec::new();
        loop {
            let (raw, escaped) = c.key()?;
            let key: &[u8] = if escaped {
                key_buf.clear();
                unescape(&c.b[raw.clone()], raw.start, &mut key_buf)?;
                &key_buf
            } else {
                &c.b[raw]
            };
            match node.find(key) {
                None => c.skip(depth + 1)?,
                Some(Slot::Field(k)) => got[*k] = self.value(c, *k, decoded, depth + 1)?,
                Some(Slot::Object(inner)) => {
                    // A repeated key replaces the whole object, as in Python.
                    inner.each_field(&mut |k| got[k] = Got::Missing);
                    match c.peek() {
                        Some(b'{') => self.object(c, inner, got, decoded, depth + 1)?,
                        Some(b'n') => {
                            let at = c.at;
                            c.literal(b"null")?;
                            inner.each_field(&mut |k| got[k] = Got::Null(at));
                        }
                        _ => {
                            let mut names = Vec::new();
                            inner.each_field(&mut |k| names.push(self.fields[k].name.as_str()));
                            return Err(c.fault(format!(
                                "`{}` is {}, not an object holding {names:?}",
                                String::from_utf8_lossy(key),
                                c.describe()
                            )));
                        }
                    }
                }
            }
            if !c.after_member()? {
                return Ok(());
            }
        }
    }

    /// Field `k`'s value at the cursor.
    fn value(
        &self,
        c: &mut Cursor<'_>,
        k: usize,
        decoded: &mut Vec<u8>,
        depth: usize,
    ) -> Step<Got> {
        let field = &self.fields[k];
        let start_at = c.at;
        if c.peek() == Some(b'n') {
            c.literal(b"null")?;
            return Ok(Got::Null(start_at));
        }
        let start = decoded.len();
        let read = match &field.kind {
            Kind::Text => {
                if c.peek() != Some(b'"') {
                    Err(Wrong::found(c))
                } else {
                    let (raw, escaped) = c.string()?;
                    if !escaped {
                        return Ok(Got::At(FieldSpan::Shared(raw)));
                    }
                    // Escapes only shorten a string: its raw length is room enough.
                    decoded.reserve(raw.len());
                    unescape(&c.b[raw.clone()], raw.start, decoded)?;
                    return Ok(Got::At(FieldSpan::Decoded(start..decoded.len())));
                }
            }
            Kind::Json => {
                c.skip(depth)?;
                return Ok(Got::At(FieldSpan::Shared(start_at..c.at)));
            }
            Kind::Tensor { dtype, shape } => {
                align(decoded, dtype.size());
                tensor(c, *dtype, shape, decoded)
            }
            Kind::List(dtype) => {
                align(decoded, dtype.size());
                if c.peek() != Some(b'[') {
                    Err(Wrong::found(c))
                } else {
                    list(c, *dtype, decoded)
                }
            }
        };
        match read {
            Ok(()) => {
                let start = start.next_multiple_of(field.kind.align().max(1));
                Ok(Got::At(FieldSpan::Decoded(start..decoded.len())))
            }
            Err(Wrong::Syntax(f)) => Err(f),
            Err(Wrong::Type { found, at }) => {
                let hint = if field.declared {
                    String::new()
                } else {
                    " (as its values in the first lines were): declare its type to read this"
                        .to_string()
                };
                let within = if at == start_at {
                    String::new()
                } else {
                    " in it".to_string()
                };
                Err(Fault {
                    at,
                    what: format!(
                        "`{}` holds {found}{within}; the field is {}{hint}",
                        field.name, field.decode
                    ),
                })
            }
            Err(Wrong::Value { why, at }) => Err(Fault {
                at,
                what: format!("`{}` (the field is {}): {why}", field.name, field.decode),
            }),
        }
    }
}
