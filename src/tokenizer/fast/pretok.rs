//! The fast path's pre-tokenizers: GPT-2's and Llama 3's splitting regexes written as state
//! machines over UTF-8, with no regex engine. Each `*_next` returns the end of the piece that
//! starts at `i`, which is the leftmost-first match of the regex at `i` (both regexes match at
//! every position of a non-empty text, so the pieces tile the text).
//!
//! GPT-2 (the `tokenizers` crate's `ByteLevel { use_regex: true }`):
//!   `'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+`
//!
//! Llama 3 (its `Split` pre-tokenizer, compiled by Oniguruma in the crate and in Python):
//!   `(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+`
//!
//! `\p{L}`, `\p{N}` and `\s` are Oniguruma's own (unicode_tables.rs, generated from the copy
//! the build compiles): the pieces equal the crate's only if the classes do. The comments
//! below derive each case of backtracking from the regex.

use super::unicode_tables::{BLOCK_INDEX, BLOCKS};

/// Character classes: the three the regexes name, and everything else.
const OTHER: u8 = 0;
const LETTER: u8 = 1;
const NUMBER: u8 = 2;
const SPACE: u8 = 3;

/// ASCII classes, the hot path (the same values as the Unicode tables).
static ASCII: [u8; 128] = {
    let mut t = [OTHER; 128];
    let mut c = 0;
    while c < 128 {
        let b = c as u8;
        t[c] = if b.is_ascii_alphabetic() {
            LETTER
        } else if b.is_ascii_digit() {
            NUMBER
        } else if matches!(b, b'\t' | b'\n' | 0x0b | 0x0c | b'\r' | b' ') {
            SPACE
        } else {
            OTHER
        };
        c += 1;
    }
    t
};

/// Class of a code point.
#[inline(always)]
fn class_of(cp: u32) -> u8 {
    if cp < 128 {
        ASCII[cp as usize]
    } else {
        BLOCKS[BLOCK_INDEX[(cp >> 8) as usize] as usize][(cp & 0xff) as usize]
    }
}

/// The character at `i` of valid UTF-8: (code point, length in bytes).
#[inline(always)]
fn decode(s: &[u8], i: usize) -> (u32, usize) {
    let b0 = s[i] as u32;
    if b0 < 0x80 {
        (b0, 1)
    } else if b0 < 0xe0 {
        (((b0 & 0x1f) << 6) | (s[i + 1] as u32 & 0x3f), 2)
    } else if b0 < 0xf0 {
        (
            ((b0 & 0x0f) << 12) | ((s[i + 1] as u32 & 0x3f) << 6) | (s[i + 2] as u32 & 0x3f),
            3,
        )
    } else {
        (
            ((b0 & 0x07) << 18)
                | ((s[i + 1] as u32 & 0x3f) << 12)
                | ((s[i + 2] as u32 & 0x3f) << 6)
                | (s[i + 3] as u32 & 0x3f),
            4,
        )
    }
}

/// Class and length of the character at `i`.
#[inline(always)]
fn class_at(s: &[u8], i: usize) -> (u8, usize) {
    let b = s[i];
    if b < 0x80 {
        (ASCII[b as usize], 1)
    } else {
        let (cp, len) = decode(s, i);
        (class_of(cp), len)
    }
}

/// End of the run of characters of class `cls` that starts at `i`.
#[inline(always)]
fn run_end(s: &[u8], mut i: usize, cls: u8) -> usize {
    while i < s.len() {
        let b = s[i];
        if b < 0x80 {
            if ASCII[b as usize] != cls {
                break;
            }
            i += 1;
        } else {
            let (c, len) = class_at(s, i);
            if c != cls {
                break;
            }
            i += len;
        }
    }
    i
}

/// Start of the last character of `s[..end]` (`end > 0`, valid UTF-8).
#[inline(always)]
fn last_char_start(s: &[u8], end: usize) -> usize {
    let mut k = end - 1;
    while s[k] & 0xc0 == 0x80 {
        k -= 1;
    }
    k
}

/// The splitting regexes the fast path knows, each written out as a state machine.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Split {
    /// GPT-2's regex (`ByteLevel` with `use_regex: true`): GPT-2, GPT-J, RoBERTa-style files.
    Gpt2,
    /// Llama 3's regex (a `Split` before `ByteLevel` with `use_regex: false`).
    Llama3,
}

impl Split {
    /// Calls `f` with each piece of `text`, in order; the pieces tile `text`.
    #[inline]
    pub(crate) fn split<'a>(self, text: &'a str, mut f: impl FnMut(&'a [u8])) {
        let s = text.as_bytes();
        let mut i = 0;
        while i < s.len() {
            let end = match self {
                Split::Gpt2 => gpt2_next(s, i),
                Split::Llama3 => llama3_next(s, i),
            };
            debug_assert!(end > i && end <= s.len());
            f(&s[i..end]);
            i = end;
        }
    }

    /// The name used in [`Engine`](crate::tokenizer::Engine)'s line.
    pub fn name(self) -> &'static str {
        match self {
            Split::Gpt2 => "GPT-2",
            Split::Llama3 => "Llama 3",
        }
    }
}

/// Length of a case-sensitive GPT-2 contraction (`'s|'t|'re|'ve|'m|'ll|'d`) at `i`, or 0.
#[inline(always)]
fn contraction_gpt2(s: &[u8], i: usize) -> usize {
    let b1 = s.get(i + 1).copied().unwrap_or(0);
    let b2 = s.get(i + 2).copied().unwrap_or(0);
    match b1 {
        b's' | b't' | b'm' | b'd' => 2,
        b'r' | b'v' if b2 == b'e' => 3,
        b'l' if b2 == b'l' => 3,
        _ => 0,
    }
}

/// Length of a case-insensitive contraction `(?i:'s|'t|'re|'ve|'m|'ll|'d)` at `i`, or 0.
/// Unicode case folding adds one character: U+017F LATIN SMALL LETTER LONG S folds to `s`
/// (U+212A KELVIN SIGN folds to `k`, which no contraction has; no character folds to `re`,
/// `ve` or `ll`).
#[inline(always)]
fn contraction_ci(s: &[u8], i: usize) -> usize {
    let b1 = s.get(i + 1).copied().unwrap_or(0);
    let b2 = s.get(i + 2).copied().unwrap_or(0);
    match b1.to_ascii_lowercase() {
        b's' | b't' | b'm' | b'd' => 2,
        b'r' | b'v' if b2.eq_ignore_ascii_case(&b'e') => 3,
        b'l' if b2.eq_ignore_ascii_case(&b'l') => 3,
        0xc5 if b2 == 0xbf => 3, // ſ (U+017F), two bytes
        _ => 0,
    }
}

/// `\s+(?!\S)|\s+` over the whitespace run `[i, j)` that ends at `j` (the end of the text, or
/// a character that is not whitespace): the piece's end.
#[inline(always)]
fn whitespace_end(s: &[u8], i: usize, j: usize) -> usize {
    if j == s.len() {
        return j;
    }
    // A non-space follows: `\s+(?!\S)` backtracks to leave the run's last character to start
    // the next piece; when the run is that one character, it fails and `\s+` takes it.
    let last = last_char_start(s, j);
    if last > i { last } else { j }
}

/// GPT-2: the end of the piece that starts at `i`.
#[inline(always)]
fn gpt2_next(s: &[u8], i: usize) -> usize {
    let n = s.len();
    let b = s[i];
    if b == b'\'' {
        let k = contraction_gpt2(s, i);
        if k > 0 {
            return i + k;
        }
    }
    // ` ?\p{L}+`, ` ?\p{N}+`, ` ?[^\s\p{L}\p{N}]+`: a space, then a run of one class.
    if b == b' ' && i + 1 < n {
        let (c2, l2) = class_at(s, i + 1);
        if c2 != SPACE {
            return run_end(s, i + 1 + l2, c2);
        }
    }
    let (c, l) = class_at(s, i);
    if c != SPACE {
        return run_end(s, i + l, c);
    }
    whitespace_end(s, i, run_end(s, i + l, SPACE))
}

/// Llama 3: the end of the piece that starts at `i`.
#[inline(always)]
fn llama3_next(s: &[u8], i: usize) -> usize {
    let n = s.len();
    let b = s[i];
    // (?i:'s|'t|'re|'ve|'m|'ll|'d)
    if b == b'\'' {
        let k = contraction_ci(s, i);
        if k > 0 {
            return i + k;
        }
    }
    let (c, l) = class_at(s, i);
    // [^\r\n\p{L}\p{N}]?\p{L}+: letters, or one character that is neither a letter, a number,
    // CR nor LF (whitespace included) before letters.
    if c == LETTER {
        return run_end(s, i + l, LETTER);
    }
    if c != NUMBER && b != b'\r' && b != b'\n' && i + l < n {
        let (c2, l2) = class_at(s, i + l);
        if c2 == LETTER {
            return run_end(s, i + l + l2, LETTER);
        }
    }
    // \p{N}{1,3}
    if c == NUMBER {
        let mut j = i + l;
        for _ in 0..2 {
            if j < n {
                let (c2, l2) = class_at(s, j);
                if c2 == NUMBER {
                    j += l2;
                    continue;
                }
            }
            break;
        }
        return j;
    }
    // ` ?[^\s\p{L}\p{N}]+[\r\n]*`
    let other_start = if c == OTHER {
        Some(i + l)
    } else if b == b' ' && i + 1 < n {
        let (c2, l2) = class_at(s, i + 1);
        (c2 == OTHER).then_some(i + 1 + l2)
    } else {
        None
    };
    if let Some(k) = other_start {
        let mut j = run_end(s, k, OTHER);
        while j < n && (s[j] == b'\r' || s[j] == b'\n') {
            j += 1;
        }
        return j;
    }
    // Whitespace. `\s*[\r\n]+`: `\s*` takes the whole run, then backtracks to the run's last
    // CR or LF, which `[\r\n]+` takes alone; so the piece ends after that CR or LF, if the run
    // has one.
    debug_assert_eq!(c, SPACE);
    let mut j = i;
    let mut last_crlf = None;
    while j < n {
        let bj = s[j];
        if bj == b'\r' || bj == b'\n' {
            last_crlf = Some(j);
            j += 1;
            continue;
        }
        let (cj, lj) = class_at(s, j);
        if cj != SPACE {
            break;
        }
        j += lj;
    }
    match last_crlf {
        Some(k) => k + 1,
        None => whitespace_end(s, i, j),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pieces(p: Split, t: &str) -> Vec<String> {
        let mut v = vec![];
        p.split(t, |x| v.push(String::from_utf8(x.to_vec()).unwrap()));
        v
    }

    #[test]
    fn gpt2_pieces() {
        let p = Split::Gpt2;
        assert_eq!(
            pieces(p, "Hello world's  end\n\n x"),
            ["Hello", " world", "'s", " ", " end", "\n\n", " x"]
        );
        assert_eq!(pieces(p, "a  \nb"), ["a", "  ", "\n", "b"]);
        assert_eq!(pieces(p, " 123 ?!"), [" 123", " ?!"]);
        assert_eq!(pieces(p, "x   "), ["x", "   "]);
        assert_eq!(pieces(p, "''s -'s"), ["''", "s", " -'", "s"]);
        assert_eq!(pieces(p, "日本語、テスト"), ["日本語", "、", "テスト"]);
        assert_eq!(pieces(p, "\u{a0}x"), ["\u{a0}", "x"]);
    }

    #[test]
    fn llama3_pieces() {
        let p = Split::Llama3;
        assert_eq!(
            pieces(p, "Hello WORLD'S 12345"),
            ["Hello", " WORLD", "'S", " ", "123", "45"]
        );
        assert_eq!(pieces(p, "a \n\n  b"), ["a", " \n\n", " ", " b"]);
        assert_eq!(pieces(p, "(x) ?!\n\ny"), ["(x", ")", " ?!\n\n", "y"]);
        assert_eq!(pieces(p, "I'ſx"), ["I", "'ſ", "x"]);
        assert_eq!(pieces(p, "\tword\u{a0}x"), ["\tword", "\u{a0}x"]);
    }

    #[test]
    fn classes_are_oniguruma_s() {
        assert_eq!(class_of('é' as u32), LETTER);
        assert_eq!(class_of('字' as u32), LETTER);
        assert_eq!(class_of('٣' as u32), NUMBER); // ARABIC-INDIC DIGIT THREE
        assert_eq!(class_of('Ⅻ' as u32), NUMBER); // ROMAN NUMERAL TWELVE (Nl)
        assert_eq!(class_of(0x3000), SPACE); // IDEOGRAPHIC SPACE
        assert_eq!(class_of(0x85), SPACE); // NEXT LINE
        assert_eq!(class_of(0x200b), OTHER); // ZERO WIDTH SPACE is not White_Space
        assert_eq!(class_of('😀' as u32), OTHER);
        assert_eq!(class_of(0x10ffff), OTHER);
    }
}
