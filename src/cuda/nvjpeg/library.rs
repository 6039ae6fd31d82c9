//! Finding and loading libnvjpeg at run time (`dlopen`), as cudarc loads the driver: no build
//! dependency, no toolkit. The library is loaded once per process and stays loaded.

use std::ffi::{CStr, CString, c_int, c_void};
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

use super::ffi::{self, Api};
use crate::error::{Error, Result};

/// The environment variable that names the library (a file, or a directory that holds
/// `libnvjpeg.so*`), looked at before anything else.
pub const NVJPEG_ENV: &str = "GPUFEED_NVJPEG";

/// The sonames tried through the dynamic loader's own search (`LD_LIBRARY_PATH`, the loader's
/// cache, the default directories), newest first.
const SONAMES: [&str; 4] = [
    "libnvjpeg.so.13",
    "libnvjpeg.so.12",
    "libnvjpeg.so.11",
    "libnvjpeg.so",
];

/// libnvjpeg, loaded: its functions and where it came from.
pub struct Library {
    pub(super) api: Api,
    path: String,
    version: (i32, i32, i32),
    /// The `dlopen` handle; never closed (nvJPEG's handles may outlive any one user).
    _handle: *mut c_void,
}

// SAFETY: the handle is only kept (never used after loading), and the function table holds
// plain function pointers into a library that stays loaded; nvJPEG's functions may be called
// from any thread (its handle is thread safe; gpufeed keeps each state on one thread).
unsafe impl Send for Library {}
// SAFETY: as above: shared use only reads the table.
unsafe impl Sync for Library {}

impl std::fmt::Debug for Library {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("nvjpeg::Library")
            .field("path", &self.path)
            .field("version", &self.version)
            .finish()
    }
}

impl Library {
    /// The library, loaded on first use from, in order: [`NVJPEG_ENV`]; the dynamic loader's
    /// search (`LD_LIBRARY_PATH`, its cache); the CUDA toolkit's directories (`CUDA_HOME`,
    /// `CUDA_PATH`, `/usr/local/cuda*`); the `nvidia-nvjpeg` wheels (`nvidia/nvjpeg/lib`,
    /// `nvidia/cu13/lib`) and torchvision's bundled copy (`torchvision.libs`) in the Python
    /// environments of `VIRTUAL_ENV`, `CONDA_PREFIX` and the system. A failure is kept: the
    /// same error on every call, [`Error::MissingLibrary`] saying what was tried and how to
    /// get the library.
    pub fn get() -> Result<Arc<Library>> {
        static LOADED: OnceLock<std::result::Result<Arc<Library>, String>> = OnceLock::new();
        match LOADED.get_or_init(|| Library::load().map(Arc::new)) {
            Ok(lib) => Ok(Arc::clone(lib)),
            Err(what) => Err(Error::MissingLibrary {
                library: "nvJPEG (libnvjpeg)",
                what: what.clone(),
            }),
        }
    }

    /// Where it was loaded from.
    pub fn path(&self) -> &str {
        &self.path
    }

    /// Its version (major, minor, patch), as `nvjpegGetProperty` reports it.
    pub fn version(&self) -> (i32, i32, i32) {
        self.version
    }

    fn load() -> std::result::Result<Library, String> {
        Library::load_from(candidates())
    }

    /// Loads the first of `candidates` that is a loadable libnvjpeg; else says what was tried.
    fn load_from(candidates: Vec<PathBuf>) -> std::result::Result<Library, String> {
        let mut tried = Vec::new();
        for candidate in candidates {
            let c = match CString::new(candidate.as_os_str().as_encoded_bytes()) {
                Ok(c) => c,
                Err(_) => continue,
            };
            // SAFETY: `c` is NUL-terminated; loading runs the library's initialisers, which for
            // libnvjpeg make no CUDA call (it loads the driver lazily).
            let handle = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
            if handle.is_null() {
                // SAFETY: dlerror returns the last error of this thread, a NUL-terminated string
                // valid until the next dl* call, or null.
                let why = unsafe {
                    let e = libc::dlerror();
                    if e.is_null() {
                        "not found".to_owned()
                    } else {
                        CStr::from_ptr(e).to_string_lossy().into_owned()
                    }
                };
                // A file that exists but does not load says why; a name not found is listed.
                if candidate.is_absolute() && candidate.exists() {
                    tried.push(format!("{} ({why})", candidate.display()));
                } else {
                    tried.push(candidate.display().to_string());
                }
                continue;
            }
            // SAFETY: `handle` is live and names a library called libnvjpeg*: NVIDIA's, whose
            // symbols of these names have these signatures.
            let api = match unsafe { Api::resolve(handle) } {
                Ok(api) => api,
                Err(missing) => {
                    tried.push(format!(
                        "{} (no function {missing}: too old an nvJPEG)",
                        candidate.display()
                    ));
                    continue;
                }
            };
            let property = |p: c_int| {
                let mut v = 0;
                // SAFETY: nvjpegGetProperty writes one int; no handle or device needed.
                let st = unsafe { (api.nvjpegGetProperty)(p, &mut v) };
                if st == ffi::STATUS_SUCCESS { v } else { -1 }
            };
            let version = (
                property(ffi::MAJOR_VERSION),
                property(ffi::MINOR_VERSION),
                property(ffi::PATCH_LEVEL),
            );
            return Ok(Library {
                api,
                path: candidate.display().to_string(),
                version,
                _handle: handle,
            });
        }
        Err(format!(
            "no loadable libnvjpeg; tried {}. Install it with `pip install nvidia-nvjpeg-cu12` \
             (or torchvision, which bundles it), or a CUDA toolkit, then set {NVJPEG_ENV} to the \
             library's path if it is not on LD_LIBRARY_PATH; decode=cpu needs none",
            tried.join(", ")
        ))
    }
}

/// Every place to try, in order (see [`Library::get`]).
fn candidates() -> Vec<PathBuf> {
    let mut out = Vec::new();
    if let Some(v) = std::env::var_os(NVJPEG_ENV).filter(|v| !v.is_empty()) {
        let p = PathBuf::from(v);
        if p.is_dir() {
            out.extend(libraries_in(&p));
        }
        out.push(p);
    }
    out.extend(SONAMES.iter().map(PathBuf::from));
    let mut dirs: Vec<PathBuf> = Vec::new();
    for var in ["CUDA_HOME", "CUDA_PATH", "CUDA_ROOT"] {
        if let Some(v) = std::env::var_os(var) {
            dirs.push(Path::new(&v).join("lib64"));
            dirs.push(Path::new(&v).join("targets/x86_64-linux/lib"));
        }
    }
    dirs.push(PathBuf::from("/usr/local/cuda/lib64"));
    dirs.push(PathBuf::from("/usr/local/cuda/targets/x86_64-linux/lib"));
    if let Ok(entries) = std::fs::read_dir("/usr/local") {
        let mut versions: Vec<PathBuf> = entries
            .flatten()
            .map(|e| e.path())
            .filter(|p| {
                p.file_name()
                    .and_then(|n| n.to_str())
                    .is_some_and(|n| n.starts_with("cuda-"))
            })
            .collect();
        versions.sort();
        versions.reverse();
        for v in versions {
            dirs.push(v.join("lib64"));
            dirs.push(v.join("targets/x86_64-linux/lib"));
        }
    }
    for prefix in python_prefixes() {
        for site in site_packages(&prefix) {
            dirs.push(site.join("nvidia/nvjpeg/lib"));
            dirs.push(site.join("nvidia/cu13/lib"));
            dirs.push(site.join("torchvision.libs"));
        }
    }
    for d in dirs {
        out.extend(libraries_in(&d));
    }
    out
}

/// The `libnvjpeg*.so*` files of `dir`, newest name first.
fn libraries_in(dir: &Path) -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut found: Vec<PathBuf> = entries
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("libnvjpeg") && n.contains(".so"))
        })
        .collect();
    found.sort();
    found.reverse();
    found
}

/// Prefixes of Python environments: the active virtual or conda environment, the user's, the
/// system's.
fn python_prefixes() -> Vec<PathBuf> {
    let mut out = Vec::new();
    for var in ["VIRTUAL_ENV", "CONDA_PREFIX"] {
        if let Some(v) = std::env::var_os(var) {
            out.push(PathBuf::from(v));
        }
    }
    if let Some(home) = std::env::var_os("HOME") {
        out.push(Path::new(&home).join(".local"));
    }
    out.push(PathBuf::from("/usr/local"));
    out.push(PathBuf::from("/usr"));
    out.push(PathBuf::from("/opt/conda"));
    out
}

/// `PREFIX/lib/python3.*/{site,dist}-packages` and Debian's `PREFIX/lib/python3/dist-packages`.
fn site_packages(prefix: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let lib = prefix.join("lib");
    if let Ok(entries) = std::fs::read_dir(&lib) {
        for e in entries.flatten() {
            let name = e.file_name();
            if name.to_str().is_some_and(|n| n.starts_with("python3")) {
                out.push(e.path().join("site-packages"));
                out.push(e.path().join("dist-packages"));
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_library_says_what_was_tried_and_how_to_get_it() {
        let dir = tempfile::tempdir().unwrap();
        let fake = dir.path().join("libnvjpeg.so.12");
        std::fs::write(&fake, b"not a library").unwrap();
        let e =
            Library::load_from(vec![dir.path().join("libnvjpeg.so.99"), fake.clone()]).unwrap_err();
        assert!(e.contains("libnvjpeg.so.99"), "{e}");
        // A file that exists but does not load says why.
        assert!(e.contains(&format!("{} (", fake.display())), "{e}");
        assert!(e.contains("pip install nvidia-nvjpeg-cu12"), "{e}");
        assert!(e.contains(NVJPEG_ENV), "{e}");
    }

    #[test]
    fn a_directory_in_the_variable_is_searched_for_the_library() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("libnvjpeg.so.12"), b"").unwrap();
        std::fs::write(dir.path().join("other.so"), b"").unwrap();
        assert_eq!(
            libraries_in(dir.path()),
            vec![dir.path().join("libnvjpeg.so.12")]
        );
    }
}
