//! gpufeed's Python extension module, `gpufeed._gpufeed`.
//!
//! The public API is in the Python files of `gpufeed/` (the `Loader` class and its argument
//! checks, `ImageOptions`, the exceptions, the torch adapter); this module does the work:
//!
//! | module | owns |
//! |---|---|
//! | `loader` | `LoaderCore`: the library's `Loader` behind a Python iterator, GIL released while waiting |
//! | `tokens` | the token loader (`gpufeed.TokenLoader`) built from its arguments, served by `LoaderCore` |
//! | `dlpack` | `Array` and the DLPack capsules that view a batch's buffer in place |
//! | `errors` | the library's errors as Python exceptions; panics caught before Python |
//! | `pack` | `pack` and `inspect`, as the command's |
//! | `tokenizer` | `gpufeed.Tokenizer`: the ids gpufeed makes of a document, to compare with the user's tokenizer's |
//! | `value` | JSON values as plain Python values and back (the loader's state) |

mod dlpack;
mod errors;
mod loader;
mod pack;
mod tokenizer;
mod tokens;
mod value;

use pyo3::prelude::*;

/// The extension module: see the module docs.
#[pymodule]
fn _gpufeed(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<loader::LoaderCore>()?;
    m.add_class::<dlpack::Array>()?;
    m.add_class::<tokenizer::Tokenizer>()?;
    m.add_function(wrap_pyfunction!(tokens::token_core, m)?)?;
    m.add_function(wrap_pyfunction!(pack::pack, m)?)?;
    m.add_function(wrap_pyfunction!(pack::inspect, m)?)?;
    m.add_function(wrap_pyfunction!(pack::read_sample, m)?)?;
    m.add_function(wrap_pyfunction!(loader::_live, m)?)?;
    m.add_function(wrap_pyfunction!(loader::_device_memory, m)?)?;
    m.add("HAS_CUDA", cfg!(feature = "cuda"))?;
    m.add("POLL_SECONDS", loader::POLL.as_secs_f64())?;
    m.add("MASK_KEY", loader::MASK_KEY)?;
    m.add("INDEX_KEY", loader::INDEX_KEY)?;
    Ok(())
}
