//! JSON values to plain Python values and back: how serde-serializable library structs (the
//! loader's state) cross as dicts of ints, strings, None, lists and dicts.

use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyDict, PyFloat, PyInt, PyList, PyString, PyTuple};
use serde_json::Value;

/// `value` as plain Python objects.
pub fn to_python<'py>(py: Python<'py>, value: &Value) -> PyResult<Bound<'py, PyAny>> {
    Ok(match value {
        Value::Null => py.None().into_bound(py),
        Value::Bool(b) => PyBool::new(py, *b).to_owned().into_any(),
        Value::Number(n) => {
            if let Some(u) = n.as_u64() {
                u.into_pyobject(py)?.into_any()
            } else if let Some(i) = n.as_i64() {
                i.into_pyobject(py)?.into_any()
            } else {
                n.as_f64().unwrap_or(f64::NAN).into_pyobject(py)?.into_any()
            }
        }
        Value::String(s) => PyString::new(py, s).into_any(),
        Value::Array(items) => {
            let list = PyList::empty(py);
            for item in items {
                list.append(to_python(py, item)?)?;
            }
            list.into_any()
        }
        Value::Object(map) => {
            let dict = PyDict::new(py);
            for (k, v) in map {
                dict.set_item(k, to_python(py, v)?)?;
            }
            dict.into_any()
        }
    })
}

/// Plain Python objects as a JSON value; `what` names the whole in errors.
pub fn from_python(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<Value> {
    if obj.is_none() {
        Ok(Value::Null)
    } else if obj.is_instance_of::<PyBool>() {
        Ok(Value::Bool(obj.extract()?))
    } else if obj.is_instance_of::<PyInt>() {
        if let Ok(u) = obj.extract::<u64>() {
            Ok(Value::from(u))
        } else {
            Ok(Value::from(obj.extract::<i64>().map_err(|_| {
                PyTypeError::new_err(format!("{what}: the integer {obj} is out of range"))
            })?))
        }
    } else if obj.is_instance_of::<PyFloat>() {
        Ok(Value::from(obj.extract::<f64>()?))
    } else if let Ok(s) = obj.cast::<PyString>() {
        Ok(Value::String(s.to_cow()?.into_owned()))
    } else if let Ok(d) = obj.cast::<PyDict>() {
        let mut map = serde_json::Map::new();
        for (k, v) in d.iter() {
            let key = k.cast::<PyString>().map_err(|_| {
                PyTypeError::new_err(format!("{what}: the key {k} is not a string"))
            })?;
            map.insert(key.to_cow()?.into_owned(), from_python(&v, what)?);
        }
        Ok(Value::Object(map))
    } else if obj.is_instance_of::<PyList>() || obj.is_instance_of::<PyTuple>() {
        let mut items = Vec::new();
        for item in obj.try_iter()? {
            items.push(from_python(&item?, what)?);
        }
        Ok(Value::Array(items))
    } else if let Ok(i) = obj.call_method0("__index__") {
        // numpy and torch integer scalars (a state that went through a checkpoint library).
        from_python(&i, what)
    } else {
        Err(PyTypeError::new_err(format!(
            "{what}: {} values cannot be read (ints, strings, None, lists and dicts only)",
            obj.get_type().name()?
        )))
    }
}
