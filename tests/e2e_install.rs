//! Installing the filter the way a mesh or a gateway does: the module as a Wasm OCI image pushed
//! to a registry and pulled back by other implementations.

#![cfg(not(target_arch = "wasm32"))]
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use common::*;

fn run(what: &str, cmd: &mut Command) -> String {
    let out = cmd.output().unwrap_or_else(|e| panic!("cannot run {what}: {e}"));
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(out.status.success(), "{what} failed:\n{text}\n{}", String::from_utf8_lossy(&out.stderr));
    text
}

fn tool(name: &str) -> &str {
    let found =
        Command::new("sh").args(["-c", &format!("command -v {name}")]).output().is_ok_and(|o| o.status.success());
    assert!(found, "{name} not found: run scripts/setup --tests (it installs Debian's docker-registry and skopeo)");
    name
}

/// Debian's `docker-registry` (the CNCF distribution registry) on a loopback port.
fn registry(dir: &Path) -> (Process, u16) {
    let port = free_port();
    let config = dir.join("registry.yml");
    let storage = dir.join("registry");
    std::fs::write(
        &config,
        format!(
            "version: 0.1\nlog: {{level: warn}}\nstorage: {{filesystem: {{rootdirectory: {}}}}}\nhttp: {{addr: 127.0.0.1:{port}}}\n",
            storage.display()
        ),
    )
    .unwrap();
    let mut cmd = Command::new(tool("docker-registry"));
    cmd.args(["serve", &config.to_string_lossy()]);
    let p = Process::spawn("docker-registry", &mut cmd, dir.join("registry.log"));
    let a = agent();
    wait_for("the registry", Duration::from_secs(20), || {
        a.get(&format!("http://127.0.0.1:{port}/v2/")).call().ok().filter(|r| r.status() == 200)
    });
    (p, port)
}

/// Pulls `image` as Istio's and Envoy Gateway's fetchers do, in Python's standard library (an
/// implementation independent of ours and of skopeo's): the manifest, its compat annotation, the
/// last layer, `plugin.wasm` out of its tar+gzip. Prints the manifest digest the registry gave.
const PULL: &str = r#"
import gzip, io, json, sys, tarfile, urllib.request
registry, name, tag, out = sys.argv[1:5]
req = urllib.request.Request(f"http://{registry}/v2/{name}/manifests/{tag}",
                             headers={"Accept": "application/vnd.oci.image.manifest.v1+json"})
with urllib.request.urlopen(req) as r:
    digest, manifest = r.headers["Docker-Content-Digest"], json.load(r)
assert manifest["annotations"]["module.wasm.image/variant"] == "compat", manifest
layer = manifest["layers"][-1]
assert layer["mediaType"] == "application/vnd.oci.image.layer.v1.tar+gzip", layer
with urllib.request.urlopen(f"http://{registry}/v2/{name}/blobs/{layer['digest']}") as r:
    blob = r.read()
with tarfile.open(fileobj=io.BytesIO(gzip.decompress(blob))) as t:
    open(out, "wb").write(t.extractfile("plugin.wasm").read())
print(digest)
"#;

/// `package --oci` and `--oci-archive` write an image that skopeo pushes to a real registry and
/// that pulls back, by another implementation, byte-identical, under the digest `package` printed.
#[test]
fn the_packaged_image_round_trips_through_a_registry() {
    let dir = scratch_dir("package");
    let module = wasm_module();
    let (_registry, port) = registry(&dir);
    let host = format!("127.0.0.1:{port}");
    let (layout, archive) = (dir.join("layout"), dir.join("image.tar"));
    let printed = |out: &str| -> String {
        out.lines()
            .find_map(|l| l.strip_prefix("image digest "))
            .and_then(|l| l.split_whitespace().next())
            .unwrap_or_else(|| panic!("no digest in {out}"))
            .to_string()
    };
    let mut cli = Command::new(cli_bin());
    let from_dir = printed(&run(
        "package --oci",
        cli.args(["package", "--tag", "v1", "--oci"]).arg(&layout).arg("--wasm").arg(&module),
    ));
    let mut cli = Command::new(cli_bin());
    let from_archive = printed(&run(
        "package --oci-archive",
        cli.args(["package", "--tag", "v2", "--oci-archive"]).arg(&archive).arg("--wasm").arg(&module),
    ));
    assert_eq!(from_dir, from_archive, "the same module, the same image");

    for (source, tag) in
        [(format!("oci:{}:v1", layout.display()), "v1"), (format!("oci-archive:{}:v2", archive.display()), "v2")]
    {
        run(
            "skopeo copy",
            Command::new(tool("skopeo")).args([
                "copy",
                "--quiet",
                "--dest-tls-verify=false",
                &source,
                &format!("docker://{host}/sgl-router:{tag}"),
            ]),
        );
        let pulled = dir.join(format!("pulled-{tag}.wasm"));
        let digest = run(
            "the Python pull",
            Command::new(repo_root().join(".venv/bin/python"))
                .args(["-c", PULL, &host, "sgl-router", tag])
                .arg(&pulled),
        );
        assert_eq!(digest.trim(), from_dir, "the registry serves the manifest `package` wrote, unchanged");
        assert!(
            std::fs::read(&pulled).unwrap() == std::fs::read(&module).unwrap(),
            "plugin.wasm pulled for {tag} differs from the module"
        );
    }
}
