//! What a fetched object's bytes are checked against once they have all arrived, before any of
//! them is read or the object enters the cache ([`ContentCheck`]), and how the fetches of one
//! object that fail their check are judged ([`Fetches`]): fetched again, refused, or (for an
//! ETag that turns out not to be a hash of the bytes) taken unchecked.

use super::Checksum;

/// A digest a fetched object must have.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum ContentCheck {
    /// The index's checksum of the shard, computed by the writer: checked end to end.
    Index(Checksum),
    /// The object's S3 ETag where it is the MD5 of its bytes ([`md5_of_etag`]): the store's
    /// copy, checked from the store to the cache.
    Md5Etag(u128),
}

impl ContentCheck {
    /// The digest of `bytes` this check compares with [`want`](ContentCheck::want).
    pub(crate) fn digest(&self, bytes: &[u8]) -> u128 {
        match self {
            ContentCheck::Index(c) => u128::from(c.of(bytes)),
            ContentCheck::Md5Etag(_) => {
                use md5::Digest;
                u128::from_be_bytes(md5::Md5::digest(bytes).into())
            }
        }
    }

    /// The digest the bytes must have.
    pub(crate) fn want(&self) -> u128 {
        match self {
            ContentCheck::Index(c) => u128::from(c.want()),
            ContentCheck::Md5Etag(m) => *m,
        }
    }

    /// What disagreed, for a message: `got` against the digest wanted.
    fn mismatch(&self, got: u128) -> String {
        match self {
            ContentCheck::Index(c) => format!(
                "{} of the bytes that arrived is {got:016x}, the index says {:016x}",
                c.name(),
                c.want()
            ),
            ContentCheck::Md5Etag(want) => format!(
                "the MD5 of the bytes that arrived is {got:032x}, the object's ETag says {want:032x}"
            ),
        }
    }
}

/// The MD5 of an object's bytes that its S3 ETag gives, if it gives one: an ETag of 32 hex
/// digits (in quotes, as S3 sends it), which is what S3 gives an object uploaded in one part
/// (a `PUT`, or a `POST` of a form). `None` for every other ETag: a multi-part upload's
/// (`"<32 hex>-<parts>"`: the MD5 of its parts' MD5s, which cannot be checked without each
/// part's size, and which `object_store` does not ask for), a weak one (`W/"..."`), or any
/// other shape. Some single-part ETags are 32 hex digits that are not an MD5 (objects
/// encrypted with SSE-KMS or SSE-C, some S3-compatible servers): [`Fetches`] finds those out.
pub(crate) fn md5_of_etag(etag: &str) -> Option<u128> {
    let hex = etag.strip_prefix('"')?.strip_suffix('"')?;
    if hex.len() != 32 || !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    u128::from_str_radix(hex, 16).ok()
}

/// What to do with an object whose fetch has just been checked.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Verdict {
    /// Its bytes are what the check wants.
    Good,
    /// They are not: fetch it again.
    Again,
    /// Two fetches gave the same bytes, which are not what an ETag says: the ETag is no MD5 of
    /// the bytes (an encrypted object's, a server's own). Take the bytes unchecked.
    NotAHash,
    /// Refuse the object: `what` says why.
    Refused {
        /// The message of the error.
        what: String,
    },
}

/// The digests of the fetches of one object that failed their check, to judge the next.
#[derive(Debug, Default)]
pub(crate) struct Fetches {
    mismatched: Vec<u128>,
}

impl Fetches {
    /// Judges a fetch whose bytes have digest `got`, after `retries` fetches again at most.
    /// A fetch whose bytes are the same as an earlier failed fetch's ends it: what the store
    /// serves is not in transit (for the index's checksum, the object is another: refused; for
    /// an ETag, the ETag is no MD5 of it).
    pub(crate) fn judge(&mut self, check: &ContentCheck, got: u128, retries: u32) -> Verdict {
        if got == check.want() {
            return Verdict::Good;
        }
        let repeated = self.mismatched.contains(&got);
        self.mismatched.push(got);
        let n = self.mismatched.len();
        match check {
            _ if !repeated && n > retries as usize => Verdict::Refused {
                what: format!("{}, on each of {n} fetches", check.mismatch(got)),
            },
            _ if !repeated => Verdict::Again,
            ContentCheck::Index(_) => Verdict::Refused {
                what: format!(
                    "{}, on {n} fetches, two of which gave the same bytes: the object in the store is not the one the index describes",
                    check.mismatch(got)
                ),
            },
            ContentCheck::Md5Etag(_) => Verdict::NotAHash,
        }
    }

    /// How many of the fetches judged so far failed their check, after a verdict: for
    /// [`Verdict::NotAHash`], those whose bytes differ from the ones taken.
    pub(crate) fn failures(&self, verdict: &Verdict) -> u64 {
        match (verdict, self.mismatched.last()) {
            (Verdict::NotAHash, Some(taken)) => {
                self.mismatched.iter().filter(|m| *m != taken).count() as u64
            }
            _ => self.mismatched.len() as u64,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_single_part_etag_is_an_md5() {
        let md5 = "\"0cc175b9c0f1b6a831c399e269772661\"";
        assert_eq!(md5_of_etag(md5), Some(0x0cc175b9c0f1b6a831c399e269772661));
        assert_eq!(
            md5_of_etag("\"0CC175B9C0F1B6A831C399E269772661\""),
            Some(0x0cc175b9c0f1b6a831c399e269772661)
        );
        for other in [
            "\"0cc175b9c0f1b6a831c399e269772661-3\"",
            "W/\"0cc175b9c0f1b6a831c399e269772661\"",
            "0cc175b9c0f1b6a831c399e269772661",
            "\"0cc175b9c0f1b6a831c399e26977266\"",
            "\"zcc175b9c0f1b6a831c399e269772661\"",
            "\"+cc175b9c0f1b6a831c399e269772661\"",
            "\"\"",
            "",
        ] {
            assert_eq!(md5_of_etag(other), None, "{other}");
        }
        let check = ContentCheck::Md5Etag(0x0cc175b9c0f1b6a831c399e269772661);
        assert_eq!(check.digest(b"a"), check.want());
    }

    #[test]
    fn fetches_are_judged_against_each_other_and_the_check() {
        let index = ContentCheck::Index(Checksum::Xxh3_64(7));
        // Transit faults: different bytes each time, then the right ones.
        let mut f = Fetches::default();
        assert_eq!(f.judge(&index, 1, 2), Verdict::Again);
        assert_eq!(f.judge(&index, 2, 2), Verdict::Again);
        assert_eq!(f.judge(&index, 7, 2), Verdict::Good);
        assert_eq!(f.failures(&Verdict::Good), 2);
        // Never right: refused after the retries.
        let mut f = Fetches::default();
        for got in 1..=2 {
            assert_eq!(f.judge(&index, got, 2), Verdict::Again);
        }
        let v = f.judge(&index, 3, 2);
        assert!(
            matches!(&v, Verdict::Refused { what } if what.contains("each of 3 fetches")),
            "{v:?}"
        );
        assert_eq!(f.failures(&v), 3);
        // The same wrong bytes twice: another object than the index's, refused at once.
        let mut f = Fetches::default();
        assert_eq!(f.judge(&index, 5, 8), Verdict::Again);
        let v = f.judge(&index, 5, 8);
        assert!(
            matches!(&v, Verdict::Refused { what } if what.contains("on 2 fetches")),
            "{v:?}"
        );
        assert_eq!(f.failures(&v), 2);
        // An ETag that is no MD5: one transit fault, then the same bytes twice.
        let etag = ContentCheck::Md5Etag(9);
        let mut f = Fetches::default();
        assert_eq!(f.judge(&etag, 4, 8), Verdict::Again);
        assert_eq!(f.judge(&etag, 5, 8), Verdict::Again);
        assert_eq!(f.judge(&etag, 5, 8), Verdict::NotAHash);
        assert_eq!(f.failures(&Verdict::NotAHash), 1);
        // No retries allowed: refused at the first failure.
        let mut f = Fetches::default();
        assert!(matches!(f.judge(&etag, 4, 0), Verdict::Refused { .. }));
    }
}
