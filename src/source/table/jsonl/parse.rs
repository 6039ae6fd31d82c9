//! One line of JSON read as Python's `json` reads it: a [`Cursor`] over the line's bytes
//! (strings, numbers, literals, and values skipped with their syntax checked), escapes
//! decoded ([`unescape`]), numbers converted to a field's dtype ([`put_number`]) by the
//! readers of a field's numbers ([`scalar`], [`tensor`], [`list`]). What is wrong is a
//! [`Fault`] at a byte of the line, or a [`Wrong`] value for a field.

use std::ops::Range;

use crate::format::DType;
use crate::source::shards::quoted;

/// How deep values may nest (objects in lists in objects...); Python's `json` stops near
/// 1,000 (its recursion limit).
pub(super) const MAX_DEPTH: usize = 512;

/// JSON's whitespace.
pub(super) fn is_ws(c: u8) -> bool {
    matches!(c, b' ' | b'\t' | b'\n' | b'\r')
}

/// Something wrong at byte `at` of a line.
#[derive(Debug)]
pub(super) struct Fault {
    pub(super) at: usize,
    pub(super) what: String,
}

pub(super) type Step<T> = std::result::Result<T, Fault>;

/// A position in a line's bytes.
pub(super) struct Cursor<'a> {
    pub(super) b: &'a [u8],
    pub(super) at: usize,
}

/// A number's digits as they are read: the first 19 as an integer, the power of ten their
/// fraction scales it by, and how many there are.
#[derive(Default)]
struct Digits {
    mantissa: u64,
    scale: i64,
    count: u32,
}

/// A number as written: its text and whether it is an integer (no fraction, no exponent).
pub(super) struct Number {
    pub(super) text: Range<usize>,
    pub(super) int: bool,
    /// Its digits as an integer and the power of ten that scales them (`12.5e3`: 125, 2),
    /// read as the number is scanned, where there are at most 19 digits and the exponent's
    /// text has at most 4; with the sign.
    pub(super) digits: Option<(u64, i64)>,
    pub(super) negative: bool,
}

impl<'a> Cursor<'a> {
    pub(super) fn new(b: &'a [u8]) -> Cursor<'a> {
        Cursor { b, at: 0 }
    }

    pub(super) fn fault(&self, what: impl Into<String>) -> Fault {
        Fault {
            at: self.at,
            what: what.into(),
        }
    }

    pub(super) fn ws(&mut self) {
        while self.b.get(self.at).copied().is_some_and(is_ws) {
            self.at += 1;
        }
    }

    pub(super) fn peek(&self) -> Option<u8> {
        self.b.get(self.at).copied()
    }

    pub(super) fn done(&self) -> bool {
        self.at >= self.b.len()
    }

    pub(super) fn eat(&mut self, c: u8) -> bool {
        if self.peek() == Some(c) {
            self.at += 1;
            true
        } else {
            false
        }
    }

    /// Nothing but the end: after a line's object.
    pub(super) fn end(&self) -> Step<()> {
        if self.done() {
            Ok(())
        } else {
            Err(self.fault("more after the object's end: each line holds one JSON object, alone"))
        }
    }

    /// The separator after a member of an object: `,` (true) or `}` (false).
    pub(super) fn after_member(&mut self) -> Step<bool> {
        self.ws();
        match self.peek() {
            Some(b',') => {
                self.at += 1;
                self.ws();
                Ok(true)
            }
            Some(b'}') => {
                self.at += 1;
                Ok(false)
            }
            _ => Err(self.expected("`,` or `}` after a value in an object")),
        }
    }

    /// The separator after an item of a list: `,` (true) or `]` (false).
    pub(super) fn after_item(&mut self) -> Step<bool> {
        self.ws();
        match self.peek() {
            Some(b',') => {
                self.at += 1;
                self.ws();
                Ok(true)
            }
            Some(b']') => {
                self.at += 1;
                Ok(false)
            }
            _ => Err(self.expected("`,` or `]` after a value in a list")),
        }
    }

    pub(super) fn expected(&self, what: &str) -> Fault {
        match self.peek() {
            // At the end of the line's text, before its newline (as Python's json counts
            // within one line).
            None => Fault {
                at: self.b.iter().rposition(|&c| !is_ws(c)).map_or(0, |p| p + 1),
                what: format!("the line ends where {what} was expected"),
            },
            Some(c) if c.is_ascii_graphic() => {
                self.fault(format!("expected {what}, found `{}`", c as char))
            }
            Some(c) => self.fault(format!(
                "expected {what}, found `{}`",
                quoted(&self.b[self.at..(self.at + utf8_len(c)).min(self.b.len())])
            )),
        }
    }

    /// A key and its colon; the cursor is at the key's quote. Returns the key's raw bytes
    /// (between the quotes) and whether it has escapes.
    pub(super) fn key(&mut self) -> Step<(Range<usize>, bool)> {
        if self.peek() != Some(b'"') {
            return Err(self.expected("a key in double quotes"));
        }
        let key = self.string()?;
        self.ws();
        if !self.eat(b':') {
            return Err(self.expected("`:` after a key"));
        }
        self.ws();
        Ok(key)
    }

    /// A string at the cursor (its opening quote): its raw bytes between the quotes and
    /// whether it has escapes (each checked to be one JSON allows). Its bytes are checked to
    /// be UTF-8 text (where they are not all ASCII): with the grammar, which allows nothing
    /// but ASCII outside strings, that checks the whole line.
    pub(super) fn string(&mut self) -> Step<(Range<usize>, bool)> {
        let open = self.at;
        self.at += 1;
        let start = self.at;
        let mut escaped = false;
        let mut ascii = true;
        loop {
            let (special, plain) = special_byte(&self.b[self.at..]);
            ascii &= plain;
            let unended = || Fault {
                at: open,
                what: "a string that does not end on its line".into(),
            };
            let Some(k) = special else {
                return Err(unended());
            };
            self.at += k;
            match self.b[self.at] {
                b'"' => {
                    let raw = start..self.at;
                    self.at += 1;
                    if !ascii && let Err(e) = std::str::from_utf8(&self.b[raw.clone()]) {
                        return Err(Fault {
                            at: raw.start + e.valid_up_to(),
                            what: "not UTF-8 text".into(),
                        });
                    }
                    return Ok((raw, escaped));
                }
                b'\\' => {}
                // The line's end (a line's bytes run to its newline, past a carriage return).
                b'\n' => return Err(unended()),
                b'\r' if self.b[self.at + 1..].iter().all(|&c| is_ws(c)) => return Err(unended()),
                _ => {
                    return Err(self.fault(
                        "a control character in a string (JSON writes it as an escape, \\n or \\u0001)",
                    ));
                }
            }
            escaped = true;
            match self.b.get(self.at + 1) {
                Some(b'"' | b'\\' | b'/' | b'b' | b'f' | b'n' | b'r' | b't') => self.at += 2,
                Some(b'u') => {
                    let hex = self.b.get(self.at + 2..self.at + 6);
                    if !hex.is_some_and(|h| h.iter().all(u8::is_ascii_hexdigit)) {
                        return Err(self.fault("`\\u` without four hexadecimal digits"));
                    }
                    self.at += 6;
                }
                _ => return Err(self.fault("an escape JSON does not have")),
            }
        }
    }

    /// A number at the cursor, as Python's `json` reads one: JSON's grammar, and `NaN`,
    /// `Infinity`, `-Infinity`.
    pub(super) fn number(&mut self) -> Step<Number> {
        let start = self.at;
        let rest = &self.b[self.at..];
        for word in [&b"NaN"[..], b"Infinity", b"-Infinity"] {
            if rest.starts_with(word) {
                self.at += word.len();
                return Ok(Number {
                    text: start..self.at,
                    int: false,
                    digits: None,
                    negative: false,
                });
            }
        }
        let negative = self.eat(b'-');
        let mut d = Digits::default();
        match self.peek() {
            Some(b'0') => {
                self.at += 1;
                d.count = 1;
            }
            Some(b'1'..=b'9') => {
                self.digits(&mut d, false);
            }
            _ => {
                self.at = start;
                return Err(self.expected("a value"));
            }
        }
        let mut int = true;
        let point = self.at;
        if self.eat(b'.') {
            int = false;
            if self.digits(&mut d, true) == 0 {
                self.at = point;
                return Err(self.fault("a decimal point without a digit after it"));
            }
        }
        let e_at = self.at;
        let mut exponent = Some(0i64);
        if matches!(self.peek(), Some(b'e' | b'E')) {
            self.at += 1;
            int = false;
            let sign = match self.peek() {
                Some(b'-') => -1,
                _ => 1,
            };
            if matches!(self.peek(), Some(b'+' | b'-')) {
                self.at += 1;
            }
            let from = self.at;
            let mut e = 0i64;
            while let Some(d @ b'0'..=b'9') = self.peek() {
                e = e.saturating_mul(10).saturating_add(i64::from(d - b'0'));
                self.at += 1;
            }
            if self.at == from {
                self.at = e_at;
                return Err(self.fault("an exponent without a digit"));
            }
            exponent = (self.at - from <= 4).then_some(sign * e);
        }
        Ok(Number {
            text: start..self.at,
            int,
            digits: exponent
                .filter(|_| d.count <= 19)
                .map(|e| (d.mantissa, d.scale + e)),
            negative,
        })
    }

    /// The digits at the cursor, added to `d` (after a decimal point if `fraction`); how many.
    fn digits(&mut self, d: &mut Digits, fraction: bool) -> usize {
        let from = self.at;
        while let Some(c @ b'0'..=b'9') = self.peek() {
            d.count += 1;
            // 19 digits always fit in a u64; past them the number is read from its text.
            if d.count <= 19 {
                d.mantissa = d.mantissa * 10 + u64::from(c - b'0');
                d.scale -= i64::from(fraction);
            }
            self.at += 1;
        }
        self.at - from
    }

    pub(super) fn literal(&mut self, word: &[u8]) -> Step<()> {
        if self.b[self.at..].starts_with(word) {
            self.at += word.len();
            Ok(())
        } else {
            Err(self.expected("a value"))
        }
    }

    /// Skips the value at the cursor, checking its syntax.
    pub(super) fn skip(&mut self, depth: usize) -> Step<()> {
        if depth > MAX_DEPTH {
            return Err(self.fault(format!("values nested more than {MAX_DEPTH} deep")));
        }
        match self.peek() {
            Some(b'{') => {
                self.at += 1;
                self.ws();
                if self.eat(b'}') {
                    return Ok(());
                }
                loop {
                    self.key()?;
                    self.skip(depth + 1)?;
                    if !self.after_member()? {
                        return Ok(());
                    }
                }
            }
            Some(b'[') => {
                self.at += 1;
                self.ws();
                if self.eat(b']') {
                    return Ok(());
                }
                loop {
                    self.skip(depth + 1)?;
                    if !self.after_item()? {
                        return Ok(());
                    }
                }
            }
            Some(b'"') => self.string().map(|_| ()),
            Some(b't') => self.literal(b"true"),
            Some(b'f') => self.literal(b"false"),
            Some(b'n') => self.literal(b"null"),
            _ => self.number().map(|_| ()),
        }
    }

    /// What the value at the cursor is, in words, for a message: `a string ("cat")`, `the
    /// float 2.5`, `a list`, ...
    pub(super) fn describe(&self) -> String {
        let rest = &self.b[self.at..];
        match rest.first() {
            Some(b'"') => {
                let end = memchr::memchr(b'"', &rest[1..]).map_or(rest.len(), |e| e + 1);
                let text = &rest[1..end];
                let cut = if text.len() > 40 { "..." } else { "" };
                format!(
                    "a string (\"{}{cut}\")",
                    quoted(&text[..text.len().min(40)])
                )
            }
            Some(b'{') => "an object".into(),
            Some(b'[') => "a list".into(),
            Some(b't') => "true".into(),
            Some(b'f') => "false".into(),
            Some(b'n') => "null".into(),
            _ => {
                let mut c = Cursor {
                    b: self.b,
                    at: self.at,
                };
                match c.number() {
                    Ok(n) if n.int => format!("the integer {}", quoted(&self.b[n.text])),
                    Ok(n) => format!("the number {}", quoted(&self.b[n.text])),
                    Err(_) => "not a value".into(),
                }
            }
        }
    }
}

/// Where the first byte that ends a string's plain run is in `b` (a quote, a backslash or a
/// control character), and whether the bytes before it are all ASCII. 32 bytes at a time,
/// in a loop of byte-wide compares and ORs that the compiler turns into vector instructions
/// (SSE2, which every x86-64 has): a string's bytes are most of a line's, and this runs at
/// 3.5 times a byte at a time, twice eight bytes at a time in a `u64` (`benches/RESULTS.md`).
fn special_byte(b: &[u8]) -> (Option<usize>, bool) {
    let ends = |c: u8| (c == b'"') | (c == b'\\') | (c < 0x20);
    let mut high = 0u8;
    let blocks = b.chunks_exact(32);
    let rest = blocks.remainder();
    for (k, block) in blocks.enumerate() {
        let Ok(block) = <&[u8; 32]>::try_from(block) else {
            break;
        };
        // Bytes, not bools: a reduction of bools is not vectorised.
        let (mut hit, mut or) = (0u8, 0u8);
        for &c in block {
            hit |= u8::from(c == b'"') | u8::from(c == b'\\') | u8::from(c < 0x20);
            or |= c;
        }
        if hit != 0 {
            let at = k * 32;
            let p = at + block.iter().position(|&c| ends(c)).unwrap_or(0);
            return (Some(p), high < 0x80 && b[at..p].is_ascii());
        }
        high |= or;
    }
    let at = b.len() - rest.len();
    let tail = rest.iter().position(|&c| ends(c)).map(|p| at + p);
    let end = tail.unwrap_or(b.len());
    (tail, high < 0x80 && b[at..end].is_ascii())
}

/// The length of the UTF-8 character that starts with `c` (1 for a byte that starts none).
pub(super) fn utf8_len(c: u8) -> usize {
    match c {
        0xf0..=0xf7 => 4,
        0xe0..=0xef => 3,
        0xc0..=0xdf => 2,
        _ => 1,
    }
}

/// The column (in characters, from 1) of byte `at` of `line`.
pub(super) fn char_column(line: &[u8], at: usize) -> u64 {
    1 + line[..at.min(line.len())]
        .iter()
        .filter(|&&c| (c & 0xc0) != 0x80)
        .count() as u64
}

/// Decodes the escapes of a string's raw bytes (`raw`, checked by [`Cursor::string`], which
/// start at byte `at` of the line) into `out`.
pub(super) fn unescape(raw: &[u8], at: usize, out: &mut Vec<u8>) -> Step<()> {
    let mut i = 0;
    while i < raw.len() {
        let Some(k) = memchr::memchr(b'\\', &raw[i..]) else {
            out.extend_from_slice(&raw[i..]);
            break;
        };
        out.extend_from_slice(&raw[i..i + k]);
        i += k;
        let c = raw.get(i + 1).copied().unwrap_or(b'\\');
        let simple = match c {
            b'"' => Some(b'"'),
            b'\\' => Some(b'\\'),
            b'/' => Some(b'/'),
            b'b' => Some(0x08),
            b'f' => Some(0x0c),
            b'n' => Some(b'\n'),
            b'r' => Some(b'\r'),
            b't' => Some(b'\t'),
            _ => None,
        };
        if let Some(s) = simple {
            out.push(s);
            i += 2;
            continue;
        }
        let hex = |j: usize| -> Option<u32> {
            let h = raw.get(j..j + 4)?;
            u32::from_str_radix(std::str::from_utf8(h).ok()?, 16).ok()
        };
        let lone = |i: usize| {
            Fault {
            at: at + i,
            what: "a lone surrogate escape (\\ud800 to \\udfff without its pair), which no UTF-8 text can hold".into(),
        }
        };
        let Some(u) = hex(i + 2) else {
            return Err(Fault {
                at: at + i,
                what: "`\\u` without four hexadecimal digits".into(),
            });
        };
        let (code, len) = match u {
            0xd800..=0xdbff => match (raw.get(i + 6..i + 8), hex(i + 8)) {
                (Some(b"\\u"), Some(low @ 0xdc00..=0xdfff)) => {
                    (0x10000 + ((u - 0xd800) << 10) + (low - 0xdc00), 12)
                }
                _ => return Err(lone(i)),
            },
            0xdc00..=0xdfff => return Err(lone(i)),
            u => (u, 6),
        };
        let ch = char::from_u32(code).ok_or_else(|| lone(i))?;
        let mut buf = [0u8; 4];
        out.extend_from_slice(ch.encode_utf8(&mut buf).as_bytes());
        i += len;
    }
    Ok(())
}

/// Pads `out` to a multiple of `to` bytes (a value's alignment within the decoded bytes).
pub(super) fn align(out: &mut Vec<u8>, to: usize) {
    if to > 1 {
        let pad = out.len().next_multiple_of(to) - out.len();
        out.resize(out.len() + pad, 0);
    }
}

/// Why a value cannot be a field's.
pub(super) enum Wrong {
    /// The value at byte `at` is of another type: what it is.
    Type { found: String, at: usize },
    /// The value at byte `at` is of the type, but cannot be held (out of range, another
    /// shape): why.
    Value { why: String, at: usize },
    /// The line's syntax.
    Syntax(Fault),
}

impl Wrong {
    /// The value at the cursor is of another type.
    pub(super) fn found(c: &Cursor<'_>) -> Wrong {
        Wrong::Type {
            found: c.describe(),
            at: c.at,
        }
    }
}

impl From<Fault> for Wrong {
    fn from(f: Fault) -> Wrong {
        Wrong::Syntax(f)
    }
}

/// The number `n` of the line `b` as `dtype`, appended to `out`.
pub(super) fn put_number(
    b: &[u8],
    n: &Number,
    dtype: DType,
    out: &mut Vec<u8>,
) -> Result<(), Wrong> {
    let text = &b[n.text.clone()];
    let at = n.text.start;
    // An integer, where it has at most 19 digits (else its text is read).
    let int = || match n.digits {
        Some((m, 0)) if n.int => Some(if n.negative {
            -i128::from(m)
        } else {
            i128::from(m)
        }),
        _ => parse_int(text),
    };
    let float = || -> f64 {
        // An integer as Python's `float(int)` converts it: rounded to nearest, ties to even
        // (as `as` rounds), and `-0` is the integer 0.
        if n.int
            && let Some(v) = int()
        {
            return v as f64;
        }
        if let Some(v) = n.digits.and_then(exact_float) {
            return if n.negative { -v } else { v };
        }
        match text {
            b"NaN" => f64::NAN,
            b"Infinity" => f64::INFINITY,
            b"-Infinity" => f64::NEG_INFINITY,
            // The grammar was checked: ASCII digits, sign, point, exponent, which Rust's
            // correctly rounded parser reads as Python's `float` does.
            t => std::str::from_utf8(t)
                .ok()
                .and_then(|t| t.parse::<f64>().ok())
                .unwrap_or(f64::NAN),
        }
    };
    match dtype {
        DType::F64 => out.extend_from_slice(&float().to_le_bytes()),
        DType::F32 => out.extend_from_slice(&(float() as f32).to_le_bytes()),
        DType::F16 => out.extend_from_slice(&half::f16::from_f64(float()).to_le_bytes()),
        DType::BF16 => out.extend_from_slice(&half::bf16::from_f64(float()).to_le_bytes()),
        DType::Bool => {
            let found = if n.int {
                format!("the integer {}", quoted(text))
            } else {
                format!("the number {}", quoted(text))
            };
            return Err(Wrong::Type { found, at });
        }
        dtype => {
            if !n.int {
                let found = format!("the number {}", quoted(text));
                return Err(Wrong::Type { found, at });
            }
            let (lo, hi): (i128, i128) = match dtype {
                DType::U8 => (0, u8::MAX.into()),
                DType::I8 => (i8::MIN.into(), i8::MAX.into()),
                DType::U16 => (0, u16::MAX.into()),
                DType::I16 => (i16::MIN.into(), i16::MAX.into()),
                DType::U32 => (0, u32::MAX.into()),
                DType::I32 => (i32::MIN.into(), i32::MAX.into()),
                DType::U64 => (0, u64::MAX.into()),
                _ => (i64::MIN.into(), i64::MAX.into()),
            };
            let Some(v) = int().filter(|v| (lo..=hi).contains(v)) else {
                let why = format!("{} does not fit in {dtype}", quoted(text));
                return Err(Wrong::Value { why, at });
            };
            out.extend_from_slice(&v.to_le_bytes()[..dtype.size()]);
        }
    }
    Ok(())
}

/// An integer's text (JSON's grammar: a sign, digits) as an `i128`, `None` if it does not fit
/// in 64 bits.
pub(super) fn parse_int(text: &[u8]) -> Option<i128> {
    let (negative, digits) = match text.split_first() {
        Some((b'-', d)) => (true, d),
        _ => (false, text),
    };
    let mut v: u64 = 0;
    for &d in digits {
        v = v.checked_mul(10)?.checked_add(u64::from(d - b'0'))?;
    }
    Some(if negative {
        -i128::from(v)
    } else {
        i128::from(v)
    })
}

/// The magnitude of `digits` (an integer and the power of ten that scales it) as an `f64`
/// when Clinger's fast path makes it exact: an integer below 2^53 scaled by at most 10^22
/// (one correctly rounded multiplication or division of two exact values); `None` for the
/// others, which Rust's full parser reads. Most numbers writers write take this path
/// (`0.3333333333`, `1e-05`), at a fraction of the full parser's cost.
pub(super) fn exact_float((mantissa, exponent): (u64, i64)) -> Option<f64> {
    const POW10: [f64; 23] = [
        1e0, 1e1, 1e2, 1e3, 1e4, 1e5, 1e6, 1e7, 1e8, 1e9, 1e10, 1e11, 1e12, 1e13, 1e14, 1e15, 1e16,
        1e17, 1e18, 1e19, 1e20, 1e21, 1e22,
    ];
    if mantissa >= 1 << 53 {
        return None;
    }
    let m = mantissa as f64;
    match exponent {
        0 => Some(m),
        1..=22 => Some(m * POW10[exponent as usize]),
        -22..=-1 => Some(m / POW10[(-exponent) as usize]),
        _ => None,
    }
}

/// One number (or bool) at the cursor as `dtype`.
pub(super) fn scalar(c: &mut Cursor<'_>, dtype: DType, out: &mut Vec<u8>) -> Result<(), Wrong> {
    match c.peek() {
        Some(b't' | b'f') if dtype == DType::Bool => {
            let v = c.peek() == Some(b't');
            c.literal(if v { b"true" } else { b"false" })?;
            out.push(u8::from(v));
            Ok(())
        }
        Some(b'-' | b'0'..=b'9' | b'N' | b'I') => {
            let n = c.number()?;
            put_number(c.b, &n, dtype, out)
        }
        _ => Err(Wrong::found(c)),
    }
}

/// Numbers nested in lists of `shape` at the cursor.
pub(super) fn tensor(
    c: &mut Cursor<'_>,
    dtype: DType,
    shape: &[u64],
    out: &mut Vec<u8>,
) -> Result<(), Wrong> {
    let Some((&n, inner)) = shape.split_first() else {
        return scalar(c, dtype, out);
    };
    if c.peek() != Some(b'[') {
        return Err(Wrong::found(c));
    }
    let at = c.at;
    c.at += 1;
    c.ws();
    let mut count = 0u64;
    if !c.eat(b']') {
        loop {
            if count == n {
                let why =
                    format!("a list of more than {n} values where the shape {shape:?} has {n}");
                return Err(Wrong::Value { why, at });
            }
            tensor(c, dtype, inner, out)?;
            count += 1;
            if !c.after_item()? {
                break;
            }
        }
    }
    if count != n {
        let why = format!("a list of {count} values where the shape {shape:?} has {n}");
        return Err(Wrong::Value { why, at });
    }
    Ok(())
}

/// A list of numbers (or bools) at the cursor (at its `[`).
pub(super) fn list(c: &mut Cursor<'_>, dtype: DType, out: &mut Vec<u8>) -> Result<(), Wrong> {
    c.at += 1;
    c.ws();
    if c.eat(b']') {
        return Ok(());
    }
    loop {
        scalar(c, dtype, out)?;
        if !c.after_item()? {
            return Ok(());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::DType;

    fn unescaped(s: &str) -> std::result::Result<String, String> {
        let mut out = Vec::new();
        unescape(s.as_bytes(), 0, &mut out).map_err(|f| f.what)?;
        Ok(String::from_utf8(out).unwrap())
    }

    #[test]
    fn escapes_decode_as_pythons_json_decodes_them() {
        assert_eq!(
            unescaped(r#"a\"b\\c\/d\n\t\r\b\f"#).unwrap(),
            "a\"b\\c/d\n\t\r\u{8}\u{c}"
        );
        assert_eq!(unescaped(r"caf\u00e9 \u732b").unwrap(), "café 猫");
        assert_eq!(unescaped(r"\ud83d\ude00!").unwrap(), "😀!");
        for lone in [r"\ud83d", r"\ud83dx", r"\ude00", r"\ud83d\u0041"] {
            assert!(
                unescaped(lone).unwrap_err().contains("lone surrogate"),
                "{lone}"
            );
        }
    }

    #[test]
    fn numbers_follow_jsons_grammar_and_pythons_constants() {
        let read = |t: &str| {
            let mut c = Cursor::new(t.as_bytes());
            c.number().map(|n| (n.text.end, n.int))
        };
        assert_eq!(read("-12,").ok(), Some((3, true)));
        assert_eq!(read("0.5e-3]").ok(), Some((6, false)));
        assert_eq!(read("NaN").ok(), Some((3, false)));
        assert_eq!(read("-Infinity").ok(), Some((9, false)));
        // `01` reads as `0` then a stray `1`, which the caller refuses.
        assert_eq!(read("01").ok(), Some((1, true)));
        for bad in ["-", ".5", "1.", "1e", "+1", "-NaN", "inf"] {
            assert!(read(bad).is_err(), "{bad}");
        }
        let put = |t: &str, d: DType| {
            let mut c = Cursor::new(t.as_bytes());
            let n = c.number().unwrap();
            let mut out = Vec::new();
            put_number(t.as_bytes(), &n, d, &mut out).map(|()| out)
        };
        assert_eq!(put("255", DType::U8).ok(), Some(vec![255]));
        assert!(matches!(put("256", DType::U8), Err(Wrong::Value { .. })));
        assert!(matches!(put("-1", DType::U64), Err(Wrong::Value { .. })));
        assert_eq!(
            put("18446744073709551615", DType::U64).ok(),
            Some(u64::MAX.to_le_bytes().to_vec())
        );
        assert!(matches!(
            put("9223372036854775808", DType::I64),
            Err(Wrong::Value { .. })
        ));
        assert!(matches!(put("1.5", DType::I64), Err(Wrong::Type { .. })));
        assert_eq!(put("3", DType::F64).ok(), Some(3f64.to_le_bytes().to_vec()));
        // The integer -0 is 0, as Python's float(-0) is 0.0; the float -0.0 keeps its sign.
        assert_eq!(
            put("-0", DType::F64).ok(),
            Some(0f64.to_le_bytes().to_vec())
        );
        assert_eq!(
            put("-0.0", DType::F64).ok(),
            Some((-0f64).to_le_bytes().to_vec())
        );
        assert_eq!(
            put("123456789012345678901234567890", DType::F64).ok(),
            Some(1.2345678901234568e29f64.to_le_bytes().to_vec())
        );
        assert_eq!(
            put("0.3333333333", DType::F64).ok(),
            Some(0.3333333333f64.to_le_bytes().to_vec())
        );
        // Rounded once, to f64, as Python's float reads it; then to f32 as NumPy converts.
        assert_eq!(
            put("0.1", DType::F32).ok(),
            Some((0.1f64 as f32).to_le_bytes().to_vec())
        );
        assert_eq!(
            put("1e400", DType::F64).ok(),
            Some(f64::INFINITY.to_le_bytes().to_vec())
        );
    }

    #[test]
    fn the_word_at_a_time_scan_finds_what_a_byte_at_a_time_scan_finds() {
        let naive = |b: &[u8]| {
            let hit = b.iter().position(|&c| c == b'"' || c == b'\\' || c < 0x20);
            (hit, b[..hit.unwrap_or(b.len())].is_ascii())
        };
        // Every place within and across words, each kind of byte that ends a run, each kind
        // of byte before it (ASCII just above the control range, `~`, `\x7f`, UTF-8 bytes).
        for len in 0..26 {
            for fill in [b'a', b' ', b'~', 0x7f, 0x80, 0xc3, 0xff] {
                let mut b = vec![fill; len];
                assert_eq!(special_byte(&b), naive(&b), "{b:?}");
                for at in 0..len {
                    for end in [b'"', b'\\', 0x00, 0x1f, b'\n'] {
                        let keep = b[at];
                        b[at] = end;
                        assert_eq!(special_byte(&b), naive(&b), "{b:?}");
                        // A second one after: the first is found.
                        if at + 3 < len {
                            b[at + 3] = b'"';
                            assert_eq!(special_byte(&b), naive(&b), "{b:?}");
                            b[at + 3] = fill;
                        }
                        b[at] = keep;
                    }
                }
            }
        }
    }

    proptest::proptest! {
        #[test]
        fn numbers_read_as_rusts_correctly_rounded_parser_reads_them(
            int in "-?(0|[1-9][0-9]{0,24})",
            frac in proptest::option::of("[0-9]{1,12}"),
            exp in proptest::option::of(-330i32..330),
        ) {
            let mut text = int;
            if let Some(f) = frac {
                text = format!("{text}.{f}");
            }
            if let Some(e) = exp {
                text = format!("{text}e{e}");
            }
            let mut c = Cursor::new(text.as_bytes());
            let n = c.number().unwrap();
            let mut out = Vec::new();
            put_number(text.as_bytes(), &n, DType::F64, &mut out).ok().unwrap();
            let want = text.parse::<f64>().unwrap();
            // An integer's text is Python's int, whose float has no negative zero.
            let want = if n.int && want == 0.0 { 0.0 } else { want };
            proptest::prop_assert_eq!(out, want.to_le_bytes().to_vec(), "{}", text);
        }
    }

    #[test]
    fn columns_count_characters_as_python_does() {
        let line = "{\"é\": x}".as_bytes();
        // `x` is at byte 7, the 7th character.
        assert_eq!(char_column(line, 7), 7);
        assert_eq!(char_column(line, 0), 1);
    }
}
