//! Tensors of a Hugging Face model directory: every `*.safetensors` file in
//! it (one file or shards; `model.safetensors.index.json` is not needed).
//!
//! Shards are read one at a time and only the tensors in the plan are
//! converted, so peak memory is the f32 model plus one shard's bytes. The
//! files are read, not memory-mapped: mapping would save a copy but makes
//! any concurrent change to the file undefined behaviour.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::safetensors::{Load, SliceSafetensors};
use candle_core::{DType, Device, Tensor};

use super::TensorSource;
use crate::error::{guarded, ModelError, Result};

/// The planned tensors of a directory, converted to f32.
#[derive(Debug)]
pub(crate) struct HfTensors {
    dir: PathBuf,
    tensors: HashMap<String, Tensor>,
}

impl HfTensors {
    /// Read the tensors named in `plan` from every safetensors file in
    /// `dir`, checking dtype and shape. A tensor absent from every file is
    /// reported by [`TensorSource::take`].
    pub(crate) fn read_dir(dir: &Path, plan: &[(String, Vec<usize>)]) -> Result<Self> {
        let wanted: HashMap<&str, &[usize]> = plan
            .iter()
            .map(|(n, s)| (n.as_str(), s.as_slice()))
            .collect();
        let mut tensors = HashMap::new();
        let mut origin: HashMap<String, PathBuf> = HashMap::new();
        for file in safetensors_files(dir)? {
            let bytes = std::fs::read(&file).map_err(|e| ModelError::io(&file, e))?;
            let st = guarded(&file, "safetensors header", || {
                SliceSafetensors::new(&bytes)
            })?;
            for (name, view) in st.tensors() {
                let Some(&expected) = wanted.get(name.as_str()) else {
                    continue;
                };
                if let Some(first) = origin.get(&name) {
                    return Err(ModelError::malformed(
                        &file,
                        format!("tensor `{name}` is also in {}", first.display()),
                    ));
                }
                let dtype = view.dtype();
                if !matches!(
                    DType::try_from(dtype),
                    Ok(DType::F32 | DType::F16 | DType::BF16)
                ) {
                    return Err(ModelError::UnsupportedDtype {
                        path: file,
                        tensor: name,
                        dtype: format!("{dtype:?}"),
                    });
                }
                if view.shape() != expected {
                    return Err(ModelError::ShapeMismatch {
                        path: file,
                        tensor: name,
                        expected: expected.to_vec(),
                        got: view.shape().to_vec(),
                    });
                }
                let tensor = guarded(&file, &format!("tensor `{name}`"), || {
                    view.load(&Device::Cpu)?.to_dtype(DType::F32)?.contiguous()
                })?;
                origin.insert(name.clone(), file.clone());
                tensors.insert(name, tensor);
            }
        }
        Ok(Self {
            dir: dir.to_owned(),
            tensors,
        })
    }
}

impl TensorSource for HfTensors {
    fn source_path(&self) -> &Path {
        &self.dir
    }

    fn take(&mut self, name: &str, expected: &[usize]) -> Result<Tensor> {
        let tensor = self
            .tensors
            .remove(name)
            .ok_or_else(|| ModelError::MissingTensor {
                path: self.dir.clone(),
                tensor: name.to_owned(),
            })?;
        if tensor.dims() != expected {
            return Err(ModelError::ShapeMismatch {
                path: self.dir.clone(),
                tensor: name.to_owned(),
                expected: expected.to_vec(),
                got: tensor.dims().to_vec(),
            });
        }
        Ok(tensor)
    }
}

/// The directory's `*.safetensors` files, sorted by name.
fn safetensors_files(dir: &Path) -> Result<Vec<PathBuf>> {
    let entries = std::fs::read_dir(dir).map_err(|e| ModelError::io(dir, e))?;
    let mut files = Vec::new();
    for entry in entries {
        let path = entry.map_err(|e| ModelError::io(dir, e))?.path();
        if path.extension().is_some_and(|ext| ext == "safetensors") && path.is_file() {
            files.push(path);
        }
    }
    if files.is_empty() {
        return Err(ModelError::MissingFile {
            path: dir.join("model.safetensors"),
            what: "*.safetensors weights",
        });
    }
    files.sort();
    Ok(files)
}
