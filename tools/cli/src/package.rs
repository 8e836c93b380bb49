//! `package`: the wasm module as a Wasm OCI image, in the variant both Istio (`WasmPlugin.url`) and
//! Envoy Gateway (`EnvoyExtensionPolicy` `code.image`) pull: solo-io's "compat" variant, an OCI
//! image manifest annotated `module.wasm.image/variant: compat` whose one layer is a tar+gzip
//! holding `plugin.wasm`. Written as an OCI image layout (a directory, or that directory as one
//! tar) that any registry client copies: `skopeo copy oci:DIR:TAG docker://REGISTRY/NAME:TAG`.
//!
//! Every byte is fixed by the module (no timestamps, owners or host names): the same module always
//! gives the same image digest, which is what Istio's `sha256` and Envoy Gateway's `image.sha256`
//! check. The module's own sha256 is what an `http`/`file` source checks.

use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};

use flate2::write::GzEncoder;
use flate2::Compression;
use serde_json::json;
use sha2::{Digest, Sha256};

/// Where the image goes.
pub enum Output<'a> {
    /// An OCI image layout directory (`oci:DIR:TAG` to skopeo).
    Dir(&'a Path),
    /// The same layout as one uncompressed tar (`oci-archive:FILE:TAG`).
    Archive(&'a Path),
}

/// What `package` wrote.
#[derive(Debug)]
pub struct Packaged {
    /// The image manifest's digest, `sha256:HEX`: Istio's `WasmPlugin.sha256` and Envoy Gateway's
    /// `image.sha256` are its HEX.
    pub image_digest: String,
    /// The module's sha256 (HEX), for `http`/`file` sources and Envoy's `remote.sha256`.
    pub module_sha256: String,
}

#[derive(Debug, thiserror::Error)]
pub enum PackageError {
    #[error("{path}: not a wasm module (it does not start with \\0asm)")]
    NotWasm { path: PathBuf },
    #[error("{path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error("{path} exists and is not an OCI image layout this command wrote; give an empty or new directory")]
    NotOurs { path: PathBuf },
}

const MANIFEST: &str = "application/vnd.oci.image.manifest.v1+json";
const CONFIG: &str = "application/vnd.oci.image.config.v1+json";
const LAYER: &str = "application/vnd.oci.image.layer.v1.tar+gzip";

/// One content-addressed blob of the layout.
struct Blob {
    digest: String,
    bytes: Vec<u8>,
}

impl Blob {
    fn new(bytes: Vec<u8>) -> Self {
        Self { digest: format!("sha256:{}", sha256_hex(&bytes)), bytes }
    }

    fn descriptor(&self, media_type: &str) -> serde_json::Value {
        json!({"mediaType": media_type, "digest": self.digest, "size": self.bytes.len()})
    }

    fn path(&self) -> String {
        format!("blobs/sha256/{}", self.digest.trim_start_matches("sha256:"))
    }
}

pub fn sha256_hex(bytes: &[u8]) -> String {
    Sha256::digest(bytes).iter().map(|b| format!("{b:02x}")).collect()
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> PackageError + '_ {
    move |source| PackageError::Io { path: path.to_path_buf(), source }
}

/// A tar of `files`, each owned by root, mode 0644, dated 0.
fn tar_of(files: &[(&str, &[u8])]) -> std::io::Result<Vec<u8>> {
    let mut builder = tar::Builder::new(Vec::new());
    for (name, bytes) in files {
        let mut header = tar::Header::new_ustar();
        header.set_size(bytes.len() as u64);
        header.set_mode(0o644);
        header.set_mtime(0);
        header.set_uid(0);
        header.set_gid(0);
        header.set_entry_type(tar::EntryType::Regular);
        builder.append_data(&mut header, name, *bytes)?;
    }
    builder.into_inner()
}

/// The image's blobs and layout files, built in memory.
struct Image {
    /// The layout's files, by path in the layout.
    files: Vec<(String, Vec<u8>)>,
    manifest_digest: String,
    module_sha256: String,
}

fn read_module(module_path: &Path) -> Result<Vec<u8>, PackageError> {
    let module = fs::read(module_path).map_err(io(module_path))?;
    if !module.starts_with(b"\0asm") {
        return Err(PackageError::NotWasm { path: module_path.to_path_buf() });
    }
    Ok(module)
}

/// The image digest `package` would print for the module at `module_path`: what Istio's and
/// Envoy Gateway's resources check the pulled image against.
pub fn image_digest(module_path: &Path) -> Result<String, PackageError> {
    Ok(image(&read_module(module_path)?, "latest").map_err(io(module_path))?.manifest_digest)
}

/// Writes the image of `module` (read from `module_path`) to `out`, tagged `tag`.
pub fn package(module_path: &Path, tag: &str, out: Output) -> Result<Packaged, PackageError> {
    let module = read_module(module_path)?;
    let image = image(&module, tag).map_err(io(module_path))?;
    let files: Vec<(String, &[u8])> = image.files.iter().map(|(n, b)| (n.clone(), b.as_slice())).collect();
    match out {
        Output::Dir(dir) => write_dir(dir, &files)?,
        Output::Archive(file) => {
            let refs: Vec<(&str, &[u8])> = files.iter().map(|(n, b)| (n.as_str(), *b)).collect();
            let archive = tar_of(&refs).map_err(io(file))?;
            fs::write(file, archive).map_err(io(file))?;
        }
    }
    Ok(Packaged { image_digest: image.manifest_digest, module_sha256: image.module_sha256 })
}

fn image(module: &[u8], tag: &str) -> std::io::Result<Image> {
    let layer_tar = tar_of(&[("plugin.wasm", module)])?;
    let diff_id = format!("sha256:{}", sha256_hex(&layer_tar));
    // gzip with no name and no time: the header is the same for the same bytes.
    let mut gz = GzEncoder::new(Vec::new(), Compression::best());
    gz.write_all(&layer_tar)?;
    let layer = Blob::new(gz.finish()?);
    let config = Blob::new(json_bytes(&json!({
        "architecture": "wasm",
        "os": "wasip1",
        "config": {},
        "rootfs": {"type": "layers", "diff_ids": [diff_id]},
    })));
    let manifest = Blob::new(json_bytes(&json!({
        "schemaVersion": 2,
        "mediaType": MANIFEST,
        "config": config.descriptor(CONFIG),
        "layers": [layer.descriptor(LAYER)],
        "annotations": {"module.wasm.image/variant": "compat"},
    })));
    let mut manifest_ref = manifest.descriptor(MANIFEST);
    manifest_ref["annotations"] = json!({"org.opencontainers.image.ref.name": tag});
    let index = json_bytes(&json!({"schemaVersion": 2, "mediaType": "application/vnd.oci.image.index.v1+json",
                                   "manifests": [manifest_ref]}));
    let layout = json_bytes(&json!({"imageLayoutVersion": "1.0.0"}));
    Ok(Image {
        files: vec![
            ("oci-layout".to_string(), layout),
            ("index.json".to_string(), index),
            (config.path(), config.bytes),
            (layer.path(), layer.bytes),
            (manifest.path(), manifest.bytes.clone()),
        ],
        manifest_digest: manifest.digest,
        module_sha256: sha256_hex(module),
    })
}

fn json_bytes(v: &serde_json::Value) -> Vec<u8> {
    v.to_string().into_bytes()
}

/// Writes the layout into `dir`: new, empty, or a layout written before (its index is replaced).
fn write_dir(dir: &Path, files: &[(String, &[u8])]) -> Result<(), PackageError> {
    if dir.exists() {
        let empty = fs::read_dir(dir).map_err(io(dir))?.next().is_none();
        if !empty && !dir.join("oci-layout").is_file() {
            return Err(PackageError::NotOurs { path: dir.to_path_buf() });
        }
    }
    fs::create_dir_all(dir.join("blobs/sha256")).map_err(io(dir))?;
    for (name, bytes) in files {
        let path = dir.join(name);
        fs::write(&path, bytes).map_err(io(&path))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn module_file(dir: &Path) -> PathBuf {
        let path = dir.join("m.wasm");
        fs::write(&path, b"\0asm\x01\0\0\0 a module").unwrap();
        path
    }

    fn scratch(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("sgl-package-{name}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn the_same_module_gives_the_same_image_digest() {
        let dir = scratch("same");
        let module = module_file(&dir);
        let a = package(&module, "v1", Output::Dir(&dir.join("a"))).unwrap();
        let b = package(&module, "v1", Output::Archive(&dir.join("b.tar"))).unwrap();
        assert_eq!(a.image_digest, b.image_digest);
        assert_eq!(a.module_sha256, sha256_hex(&fs::read(&module).unwrap()));
        let manifest = fs::read(dir.join("a/blobs/sha256").join(a.image_digest.trim_start_matches("sha256:"))).unwrap();
        assert_eq!(format!("sha256:{}", sha256_hex(&manifest)), a.image_digest);
        let m: serde_json::Value = serde_json::from_slice(&manifest).unwrap();
        assert_eq!(m["annotations"]["module.wasm.image/variant"], "compat");
        assert_eq!(m["layers"].as_array().unwrap().len(), 1);
    }

    #[test]
    fn a_file_that_is_not_wasm_and_a_foreign_directory_are_refused() {
        let dir = scratch("refused");
        fs::write(dir.join("x.wasm"), b"not wasm").unwrap();
        assert!(matches!(
            package(&dir.join("x.wasm"), "t", Output::Dir(&dir.join("o"))),
            Err(PackageError::NotWasm { .. })
        ));
        fs::write(dir.join("other"), b"").unwrap();
        let module = module_file(&dir);
        assert!(matches!(package(&module, "t", Output::Dir(&dir)), Err(PackageError::NotOurs { .. })));
    }
}
