//! Model directories in the mlx-lm layout, read and written the way mlx-lm does it: the
//! weight files of a directory ([`weight_files`], mlx-lm's `load_model`), the shard plan and
//! index of a written one ([`ShardPlan`], mlx-lm's `make_shards` / `save_model`), the
//! tokenizer and template files copied beside the weights ([`copy_aux_files`]), and a
//! staging directory that becomes the destination only when complete ([`StagedDir`]).
//!
//! `quantize`, `import-gguf` and `quantize-drafter` all write through [`StagedDir`]: the
//! output is built in a hidden directory beside the destination and renamed into place in
//! one step, so a failed or interrupted run leaves neither a partial destination nor the
//! staging directory. Errors and dropped values clean up at once; for SIGINT / SIGTERM a
//! program calls [`clean_up_on_signals`] once (the `mlx-spec` binary does).
use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard, PoisonError};

use serde_json::{Value, json};

use crate::{Error, Result};

/// The largest weight file written before a new shard starts: mlx-lm's `MAX_FILE_SIZE_GB`
/// (5 GiB).
pub const MAX_SHARD_BYTES: u64 = 5 << 30;

/// The index file of a sharded model directory.
pub const INDEX_FILE: &str = "model.safetensors.index.json";

fn file_err(path: &Path, message: impl Into<String>) -> Error {
    Error::File { path: path.into(), message: message.into() }
}

/// The weight files of the model directory `dir`: the files named by the `weight_map` of
/// `model.safetensors.index.json` when it exists (sorted, each once), else the files
/// matching `model*.safetensors` (mlx-lm's `load_model` glob), sorted. Other
/// `*.safetensors` files beside the model (evaluation outputs, optimizer state) are not
/// weights and are never read. DeepSpec drafter checkpoints (`save_pretrained`) are
/// `model.safetensors`, or `model-0000i-of-0000N.safetensors` with an index.
///
/// # Errors
/// [`Error::File`] naming the index when it cannot be read, is not JSON, has no
/// `weight_map` object or names a file that does not exist; naming `dir` when it cannot be
/// listed or holds no `model*.safetensors` file.
pub fn weight_files(dir: &Path) -> Result<Vec<PathBuf>> {
    let index = dir.join(INDEX_FILE);
    if index.is_file() {
        let text = std::fs::read_to_string(&index).map_err(|e| file_err(&index, format!("cannot read: {e}")))?;
        let v: Value = serde_json::from_str(&text).map_err(|e| file_err(&index, format!("not valid JSON: {e}")))?;
        let map =
            v.get("weight_map").and_then(Value::as_object).ok_or_else(|| file_err(&index, "no `weight_map` object"))?;
        let shards: BTreeSet<&str> = map.values().filter_map(Value::as_str).collect();
        let files: Vec<PathBuf> = shards.into_iter().map(|s| dir.join(s)).collect();
        if let Some(missing) = files.iter().find(|f| !f.is_file()) {
            return Err(file_err(
                &index,
                format!("the weight file {} listed in `weight_map` does not exist", missing.display()),
            ));
        }
        return Ok(files);
    }
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .map_err(|e| file_err(dir, format!("cannot list the model directory: {e}")))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("model") && n.ends_with(".safetensors"))
                && p.is_file()
        })
        .collect();
    files.sort();
    if files.is_empty() {
        return Err(file_err(dir, "no model*.safetensors weight files (and no model.safetensors.index.json)"));
    }
    Ok(files)
}

/// The name of weight file `i` (0-based) of `n`: `model.safetensors` for one file, else
/// `model-0000{i+1}-of-0000{n}.safetensors` (mlx-lm's `save_model`).
pub fn shard_file_name(i: usize, n: usize) -> String {
    if n == 1 { "model.safetensors".to_string() } else { format!("model-{:05}-of-{:05}.safetensors", i + 1, n) }
}

/// How the tensors of a model are split into weight files, with mlx-lm's rule
/// (`make_shards`): tensors in the order given fill a file until the next one would push it
/// past the maximum size, then a new file starts. A single tensor larger than the maximum
/// gets a file of its own (mlx-lm would leave an empty file before it).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShardPlan {
    /// Per file: its tensors in order and their bytes.
    shards: Vec<(Vec<String>, u64)>,
    shard_of: HashMap<String, usize>,
}

impl ShardPlan {
    /// Plans `tensors` (`(name, bytes)`, in file order) into files of at most
    /// `max_shard_bytes`. mlx-lm fills its shards in the model's parameter order; the
    /// writers of this workspace pass the names sorted.
    pub fn new<S: Into<String>>(tensors: impl IntoIterator<Item = (S, u64)>, max_shard_bytes: u64) -> Self {
        let mut shards: Vec<(Vec<String>, u64)> = Vec::new();
        let mut shard_of = HashMap::new();
        for (name, n) in tensors {
            let name = name.into();
            match shards.last_mut() {
                Some((names, bytes)) if *bytes + n <= max_shard_bytes => {
                    names.push(name.clone());
                    *bytes += n;
                }
                _ => shards.push((vec![name.clone()], n)),
            }
            shard_of.insert(name, shards.len() - 1);
        }
        ShardPlan { shards, shard_of }
    }

    /// Number of weight files.
    pub fn len(&self) -> usize {
        self.shards.len()
    }

    /// Whether no tensor was planned.
    pub fn is_empty(&self) -> bool {
        self.shards.is_empty()
    }

    /// The file name of shard `i` ([`shard_file_name`]).
    pub fn file_name(&self, i: usize) -> String {
        shard_file_name(i, self.len())
    }

    /// Every file name, in order.
    pub fn file_names(&self) -> Vec<String> {
        (0..self.len()).map(|i| self.file_name(i)).collect()
    }

    /// The shard holding tensor `name`.
    pub fn shard_of(&self, name: &str) -> Option<usize> {
        self.shard_of.get(name).copied()
    }

    /// The tensors of shard `i`, in order.
    pub fn tensors(&self, i: usize) -> &[String] {
        &self.shards[i].0
    }

    /// The data bytes of shard `i` (headers excluded).
    pub fn bytes(&self, i: usize) -> u64 {
        self.shards[i].1
    }

    /// The data bytes of all shards (mlx-lm's `total_size`).
    pub fn total_bytes(&self) -> u64 {
        self.shards.iter().map(|s| s.1).sum()
    }

    /// The index as mlx-lm's `save_model` writes it: `metadata` with `total_size` and
    /// `total_parameters`, `weight_map` from each tensor name to its file, sorted by name.
    pub fn index(&self, total_parameters: u64) -> Value {
        let mut names: Vec<(&String, usize)> = self.shard_of.iter().map(|(n, &i)| (n, i)).collect();
        names.sort();
        let weight_map: serde_json::Map<String, Value> =
            names.into_iter().map(|(n, i)| (n.clone(), json!(self.file_name(i)))).collect();
        json!({
            "metadata": {"total_size": self.total_bytes(), "total_parameters": total_parameters},
            "weight_map": weight_map,
        })
    }

    /// Writes [`ShardPlan::index`] to `dir/model.safetensors.index.json`.
    ///
    /// # Errors
    /// [`Error::File`] naming the index when it cannot be written.
    pub fn write_index(&self, dir: &Path, total_parameters: u64) -> Result<()> {
        write_json(&dir.join(INDEX_FILE), &self.index(total_parameters))
    }
}

/// Writes `v` as JSON with 4-space indentation and a trailing newline (mlx-lm's
/// `json.dump(..., indent=4)`), atomically ([`write_atomic`]).
///
/// # Errors
/// [`Error::File`] naming `path` when it cannot be written.
pub fn write_json(path: &Path, v: &impl serde::Serialize) -> Result<()> {
    let mut buf = Vec::new();
    let mut ser =
        serde_json::Serializer::with_formatter(&mut buf, serde_json::ser::PrettyFormatter::with_indent(b"    "));
    v.serialize(&mut ser).map_err(|e| file_err(path, format!("cannot serialize JSON: {e}")))?;
    buf.push(b'\n');
    write_atomic(path, &buf)
}

/// Writes `bytes` to `path` through a hidden temporary file beside it (`.NAME.tmp-PID`, so
/// that two processes writing the same file do not share one), renamed into place once
/// complete: a reader sees the old file or the new one, never a part.
///
/// # Errors
/// [`Error::File`] naming `path` when it cannot be written (the temporary file is removed).
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let tmp = path.with_file_name(format!(".{name}.tmp-{}", std::process::id()));
    let written = std::fs::write(&tmp, bytes).and_then(|_| std::fs::rename(&tmp, path));
    written.map_err(|e| {
        let _ = std::fs::remove_file(&tmp);
        file_err(path, format!("cannot write: {e}"))
    })
}

/// Whether `name` is a file a converted model directory takes from its source: tokenizer
/// files, chat templates, generation and processor configs, custom model code (`*.py`).
/// Weights, `config.json`, the index and hidden files are not.
pub fn is_aux_file(name: &str) -> bool {
    if name.starts_with('.') || name.ends_with(".safetensors") {
        return false;
    }
    if matches!(name, "config.json" | INDEX_FILE) {
        return false;
    }
    name.starts_with("tokenizer")
        || name.starts_with("vocab")
        || name.starts_with("chat_template")
        || name.ends_with(".tiktoken")
        || name.ends_with(".py")
        || matches!(
            name,
            "special_tokens_map.json"
                | "added_tokens.json"
                | "merges.txt"
                | "generation_config.json"
                | "preprocessor_config.json"
                | "processor_config.json"
                | "tiktoken.model"
        )
}

/// Copies the files of `src` that [`is_aux_file`] selects into `dir`; returns their names,
/// sorted.
///
/// # Errors
/// [`Error::File`] naming `src` when it cannot be listed, or the file that cannot be copied.
pub fn copy_aux_files(src: &Path, dir: &Path) -> Result<Vec<String>> {
    let mut copied = Vec::new();
    for e in std::fs::read_dir(src).map_err(|e| file_err(src, format!("cannot list: {e}")))? {
        let e = e.map_err(|e| file_err(src, format!("cannot list: {e}")))?;
        let Some(name) = e.file_name().to_str().map(str::to_owned) else { continue };
        if !is_aux_file(&name) || !e.path().is_file() {
            continue;
        }
        std::fs::copy(e.path(), dir.join(&name))
            .map_err(|err| file_err(&e.path(), format!("cannot copy into {}: {err}", dir.display())))?;
        copied.push(name);
    }
    copied.sort();
    Ok(copied)
}

/// The label of the name an old destination is moved aside to while `--force` replaces it:
/// `.<name>.replaced-<pid>-XXXXXX`.
const REPLACED_LABEL: &str = "replaced";

/// A staging directory being removed on a signal: the directory and the parents created
/// for its destination (deepest first).
struct Live {
    dir: PathBuf,
    created: Vec<PathBuf>,
}

/// Every live [`StagedDir`], for the signal handler of [`clean_up_on_signals`]. Creating,
/// committing and cleaning a staging directory hold this lock, so the handler sees each one
/// either before it exists or complete.
static LIVE: Mutex<Vec<Live>> = Mutex::new(Vec::new());

fn live() -> MutexGuard<'static, Vec<Live>> {
    LIVE.lock().unwrap_or_else(PoisonError::into_inner)
}

fn remove_live(entry: &Live) {
    // The writer may still be creating a file in it: retry until the directory is gone.
    for _ in 0..20 {
        match std::fs::remove_dir_all(&entry.dir) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => std::thread::yield_now(),
            _ => break,
        }
    }
    for d in &entry.created {
        let _ = std::fs::remove_dir(d);
    }
}

/// Creates the staging directory `<prefix><pid>-XXXXXX` in `parent`: the process id lets a
/// later run tell a staging directory whose writer is gone ([`remove_stale_staging`]).
///
/// # Errors
/// The OS error when it cannot be created.
pub fn staging_dir(parent: &Path, prefix: &str) -> std::io::Result<tempfile::TempDir> {
    tempfile::Builder::new().prefix(&format!("{prefix}{}-", std::process::id())).tempdir_in(parent)
}

/// Removes the entries of `parent` named `<prefix><pid>-*` ([`staging_dir`]) whose
/// process `<pid>` no longer runs (no `/proc/<pid>`), i.e. staging directories and partial
/// downloads of a process killed before it could clean up; returns how many. Entries of
/// running processes (another run writing right now) are left alone. On systems without
/// `/proc` it removes nothing.
pub fn remove_stale_staging(parent: &Path, prefix: &str) -> usize {
    let proc_fs = Path::new("/proc/self").exists();
    let Ok(entries) = std::fs::read_dir(parent) else { return 0 };
    let mut removed = 0;
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(pid) = name.to_str().and_then(|n| n.strip_prefix(prefix)).and_then(|rest| rest.split('-').next())
        else {
            continue;
        };
        let Ok(pid) = pid.parse::<u32>() else { continue };
        if !proc_fs || pid == std::process::id() || Path::new(&format!("/proc/{pid}")).exists() {
            continue;
        }
        let path = entry.path();
        let gone = if path.is_dir() { std::fs::remove_dir_all(&path) } else { std::fs::remove_file(&path) };
        removed += usize::from(gone.is_ok());
    }
    removed
}

/// A hidden directory beside a destination that receives a model directory's files and
/// becomes the destination by one rename ([`StagedDir::commit`]).
///
/// Dropping it uncommitted (an error, a panic) removes it and the parent directories
/// [`StagedDir::create`] made; with [`clean_up_on_signals`] installed, SIGINT or SIGTERM
/// does the same before the process exits.
#[derive(Debug)]
pub struct StagedDir {
    dir: PathBuf,
    dst: PathBuf,
    created: Vec<PathBuf>,
    committed: bool,
}

impl StagedDir {
    /// Creates `.<name>.<label>-<pid>-XXXXXX` in the parent of `dst` (creating missing
    /// parents), where `<name>` is the final component of `dst`, e.g.
    /// `.q4.quantizing-4242-Ab12Cd`. Staging directories of the same name and label left by a
    /// process that no longer runs (killed with SIGKILL, power loss) are removed first
    /// ([`remove_stale_staging`]).
    ///
    /// # Errors
    /// [`Error::File`] naming `dst` when it has no final component or a parent cannot be
    /// created (the message names it), or the staging directory cannot be created there.
    pub fn create(dst: &Path, label: &str) -> Result<Self> {
        let name = dst
            .file_name()
            .and_then(|n| n.to_str())
            .ok_or_else(|| file_err(dst, "the destination needs a UTF-8 final path component"))?;
        let parent = match dst.parent() {
            Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
            _ => PathBuf::from("."),
        };
        let mut registry = live();
        let mut created = Vec::new();
        let mut d = Some(parent.as_path());
        while let Some(p) = d {
            if p.as_os_str().is_empty() || std::fs::symlink_metadata(p).is_ok() {
                break;
            }
            created.push(p.to_path_buf());
            d = p.parent();
        }
        let undo = |created: &[PathBuf]| created.iter().for_each(|d| drop(std::fs::remove_dir(d)));
        if !created.is_empty()
            && let Err(e) = std::fs::create_dir_all(&parent)
        {
            undo(&created);
            return Err(file_err(dst, format!("cannot create its parent directory {}: {e}", parent.display())));
        }
        let prefix = format!(".{name}.{label}-");
        remove_stale_staging(&parent, &prefix);
        // An old destination a killed run had moved aside to replace it (`commit` with
        // `replace`): the new output was in place, or the old one is given up for the new.
        remove_stale_staging(&parent, &format!(".{name}.{REPLACED_LABEL}-"));
        let dir = match staging_dir(&parent, &prefix) {
            Ok(t) => t.keep(),
            Err(e) => {
                undo(&created);
                return Err(file_err(dst, format!("cannot create a temporary directory in {}: {e}", parent.display())));
            }
        };
        registry.push(Live { dir: dir.clone(), created: created.clone() });
        Ok(StagedDir { dir, dst: dst.into(), created, committed: false })
    }

    /// The staging directory, to write the files into.
    pub fn path(&self) -> &Path {
        &self.dir
    }

    /// The destination it becomes.
    pub fn destination(&self) -> &Path {
        &self.dst
    }

    /// `path` as the user named it: a path inside the staging directory becomes the same
    /// path under the destination, so that a message says `q4/model.safetensors: No space
    /// left on device`, not `.q4.quantizing-4242-Ab12Cd/model.safetensors` (a name the user
    /// never gave, and gone once the error has removed the staging directory). Other paths
    /// (the sources) are returned unchanged.
    pub fn shown(&self, path: &Path) -> PathBuf {
        match path.strip_prefix(&self.dir) {
            Ok(rel) if rel.as_os_str().is_empty() => self.dst.clone(),
            Ok(rel) => self.dst.join(rel),
            Err(_) => path.to_path_buf(),
        }
    }

    /// Renames the staging directory to the destination. When the destination exists and
    /// `replace` is set (and it is a directory), it is first moved aside to
    /// `.<name>.replaced-<pid>-XXXXXX` and removed only after the rename succeeded (restored
    /// otherwise). A process killed (SIGKILL) before that removal ended leaves the old
    /// directory there; the next [`StagedDir::create`] for the same destination removes it.
    ///
    /// # Errors
    /// [`Error::File`] naming the destination when it appeared meanwhile (without `replace`,
    /// or not as a directory) or a rename fails; the staging directory is removed then.
    pub fn commit(mut self, replace: bool) -> Result<()> {
        let mut registry = live();
        let moved = move_into_place(&self.dir, &self.dst, replace);
        if moved.is_ok() {
            registry.retain(|l| l.dir != self.dir);
            self.committed = true;
        }
        drop(registry);
        moved
    }
}

impl Drop for StagedDir {
    fn drop(&mut self) {
        if self.committed {
            return;
        }
        let mut registry = live();
        registry.retain(|l| l.dir != self.dir);
        remove_live(&Live { dir: self.dir.clone(), created: std::mem::take(&mut self.created) });
    }
}

/// Refuses a destination that is, holds, or lies inside `source` (a file or a directory),
/// comparing the paths with symlinks resolved (a destination that does not exist yet is
/// resolved through its nearest existing ancestor). `--force` does not change this: writing
/// or replacing such a destination would destroy the input or write into it.
///
/// # Errors
/// [`Error::File`] naming `dst`, the source and which of the three it is.
pub fn check_apart(source: &Path, dst: &Path) -> Result<()> {
    let (s, d) = (resolve(source), resolve(dst));
    let why = if s == d {
        "is the source"
    } else if s.starts_with(&d) {
        "holds the source"
    } else if d.starts_with(&s) {
        "lies inside the source"
    } else {
        return Ok(());
    };
    Err(file_err(
        dst,
        format!(
            "{why} {}; write the output elsewhere (an input is never replaced or written into, not even with \
             --force)",
            source.display()
        ),
    ))
}

/// `path` absolute, with symlinks resolved as far as it exists and the missing rest
/// appended (as given when even the root cannot be resolved).
fn resolve(path: &Path) -> PathBuf {
    let abs = std::path::absolute(path).unwrap_or_else(|_| path.to_path_buf());
    let mut existing = abs.as_path();
    let mut missing = Vec::new();
    loop {
        if let Ok(real) = existing.canonicalize() {
            return missing.iter().rev().fold(real, |p, name| p.join(name));
        }
        match (existing.file_name(), existing.parent()) {
            (Some(name), Some(parent)) => {
                missing.push(name.to_os_string());
                existing = parent;
            }
            _ => return abs,
        }
    }
}

/// Refuses to replace `dst` unless it is a model directory (it holds `config.json`) or an
/// empty directory: `--force` replaces an earlier output, never a directory that merely
/// contains one (`--out .`, `--out ~`, the parent of the source).
///
/// # Errors
/// [`Error::File`] naming `dst` and what it is.
pub fn check_replaceable(dst: &Path) -> Result<()> {
    if !dst.is_dir() {
        return Err(file_err(dst, "exists and is not a directory; it is not replaced even with --force"));
    }
    let empty = std::fs::read_dir(dst).map(|mut d| d.next().is_none()).unwrap_or(false);
    if !empty && !dst.join("config.json").is_file() {
        return Err(file_err(
            dst,
            "is neither a model directory (no config.json) nor empty; it is not replaced even with --force",
        ));
    }
    Ok(())
}

fn move_into_place(staged: &Path, dst: &Path, replace: bool) -> Result<()> {
    let fail = |e: std::io::Error| file_err(dst, format!("cannot move the output into place: {e}"));
    if std::fs::symlink_metadata(dst).is_err() {
        return std::fs::rename(staged, dst).map_err(fail);
    }
    if !replace {
        return Err(file_err(dst, "appeared while the output was being written"));
    }
    check_replaceable(dst)?;
    // A fresh name beside the destination (not one a killed earlier run may have left).
    let parent = dst.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    let name = dst.file_name().and_then(|n| n.to_str()).unwrap_or("out");
    // The process id lets the next run tell it left by a killed process (`StagedDir::create`).
    let aside = tempfile::Builder::new()
        .prefix(&format!(".{name}.{REPLACED_LABEL}-{}-", std::process::id()))
        .tempdir_in(parent)
        .map_err(|e| file_err(dst, format!("cannot make a name to move the old directory aside: {e}")))?
        .keep();
    std::fs::remove_dir(&aside).map_err(|e| file_err(&aside, format!("cannot prepare the aside name: {e}")))?;
    std::fs::rename(dst, &aside).map_err(fail)?;
    if let Err(e) = std::fs::rename(staged, dst) {
        return Err(match std::fs::rename(&aside, dst) {
            Ok(()) => fail(e),
            Err(r) => file_err(
                dst,
                format!(
                    "cannot move the output into place ({e}) nor restore the old directory ({r}); it is at {}",
                    aside.display()
                ),
            ),
        });
    }
    // The new output is in place: an old copy that cannot be removed is only reported.
    if let Err(e) = std::fs::remove_dir_all(&aside) {
        eprintln!("warning: {}: cannot remove the replaced directory: {e}", aside.display());
    }
    Ok(())
}

/// Makes SIGINT and SIGTERM remove every live [`StagedDir`] (and the parents it created),
/// then exit with status 130 or 143 (128 + the signal), as a shell reports a process the
/// signal ended. Installed once per process (later calls do nothing) on a thread of
/// `signal-hook`'s iterator; meant for programs, such as the `mlx-spec` binary, that write
/// model directories and have no signal handling of their own. Does nothing on non-Unix
/// targets.
///
/// # Errors
/// [`Error::Invalid`] when the handler cannot be registered or its thread started.
pub fn clean_up_on_signals() -> Result<()> {
    #[cfg(unix)]
    {
        use signal_hook::consts::{SIGINT, SIGTERM};
        static INSTALLED: Mutex<bool> = Mutex::new(false);
        let mut installed = INSTALLED.lock().unwrap_or_else(PoisonError::into_inner);
        if *installed {
            return Ok(());
        }
        let invalid = |e: std::io::Error| Error::Invalid { op: "clean_up_on_signals", message: e.to_string() };
        let mut signals = signal_hook::iterator::Signals::new([SIGINT, SIGTERM]).map_err(invalid)?;
        std::thread::Builder::new()
            .name("staged-dir-cleanup".into())
            .spawn(move || {
                if let Some(sig) = signals.forever().next() {
                    let registry = live();
                    registry.iter().for_each(remove_live);
                    // Exit holding the lock: no staging directory is created or committed
                    // after the cleanup. `_exit`, not `std::process::exit`: no atexit
                    // handlers or C++ static destructors (MLX's) run while the main thread
                    // may still be computing, as with the default action of the signal.
                    signal_hook::low_level::exit(128 + sig);
                }
            })
            .map_err(invalid)?;
        *installed = true;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_destination_apart_from_its_source_passes_and_no_other() {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path();
        let src = root.join("src");
        std::fs::create_dir_all(src.join("sub")).unwrap();
        std::fs::write(src.join("model.gguf"), b"x").unwrap();
        std::os::unix::fs::symlink(&src, root.join("link")).unwrap();
        let gguf = src.join("model.gguf");
        for (s, d, why) in [
            (&src, src.clone(), "is the source"),
            (&src, root.join("link"), "is the source"),
            (&src, root.to_path_buf(), "holds the source"),
            (&gguf, src.clone(), "holds the source"),
            (&gguf, root.join("link"), "holds the source"),
            (&src, src.join("q4"), "lies inside the source"),
            (&src, root.join("link/new/deeper"), "lies inside the source"),
            (&src, src.join("sub/q4"), "lies inside the source"),
        ] {
            let e = check_apart(s, &d).unwrap_err().to_string();
            assert!(e.contains(why) && e.contains(&d.display().to_string()), "{} -> {}: {e}", s.display(), d.display());
        }
        for d in [root.join("out"), root.join("src2"), root.join("new/src")] {
            check_apart(&src, &d).unwrap();
        }
        check_apart(&gguf, &src.join("model.gguf.d")).unwrap();
        check_apart(&gguf, &root.join("out")).unwrap();
    }

    #[test]
    fn shards_follow_mlx_lm() {
        let p = ShardPlan::new([("a", 4u64), ("b", 4), ("c", 3), ("d", 20), ("e", 1)], 10);
        assert_eq!(p.len(), 4);
        assert_eq!(p.tensors(0), ["a", "b"]);
        assert_eq!(p.tensors(2), ["d"], "a tensor over the limit gets a file of its own");
        assert_eq!(p.file_name(0), "model-00001-of-00004.safetensors");
        assert_eq!(p.total_bytes(), 32);
        let index = p.index(7);
        assert_eq!(index["metadata"]["total_size"], 32);
        assert_eq!(index["weight_map"]["e"], "model-00004-of-00004.safetensors");
        assert_eq!(ShardPlan::new([("a", 4u64)], 10).file_names(), ["model.safetensors"]);
    }

    #[test]
    fn weight_files_ignore_other_safetensors() {
        let tmp = tempfile::tempdir().unwrap();
        let d = tmp.path();
        assert!(weight_files(d).is_err());
        for f in ["model.safetensors", "eval_outputs.safetensors", "model-extra.safetensors"] {
            std::fs::write(d.join(f), "").unwrap();
        }
        assert_eq!(weight_files(d).unwrap(), [d.join("model-extra.safetensors"), d.join("model.safetensors")]);
        std::fs::write(d.join(INDEX_FILE), r#"{"weight_map": {"x": "model.safetensors"}}"#).unwrap();
        assert_eq!(weight_files(d).unwrap(), [d.join("model.safetensors")]);
    }

    #[test]
    fn staged_dir_commits_or_leaves_nothing() {
        let tmp = tempfile::tempdir().unwrap();
        let dst = tmp.path().join("new/deeper/out");
        let s = StagedDir::create(&dst, "testing").unwrap();
        std::fs::write(s.path().join("f"), "x").unwrap();
        drop(s);
        assert_eq!(std::fs::read_dir(tmp.path()).unwrap().count(), 0, "staging and parents removed");
        let s = StagedDir::create(&dst, "testing").unwrap();
        std::fs::write(s.path().join("f"), "x").unwrap();
        s.commit(false).unwrap();
        assert!(dst.join("f").is_file());
        let s = StagedDir::create(&dst, "testing").unwrap();
        let e = s.commit(true).unwrap_err().to_string();
        assert!(e.contains("neither a model directory"), "a directory without config.json is not replaced: {e}");
        std::fs::write(dst.join("config.json"), "{}").unwrap();
        let s = StagedDir::create(&dst, "testing").unwrap();
        assert!(s.commit(false).is_err(), "an existing destination is kept without replace");
        let s = StagedDir::create(&dst, "testing").unwrap();
        std::fs::write(s.path().join("g"), "y").unwrap();
        s.commit(true).unwrap();
        assert!(dst.join("g").is_file() && !dst.join("f").exists());
        let names: Vec<_> = std::fs::read_dir(dst.parent().unwrap()).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert_eq!(names, ["out"]);
    }

    #[test]
    #[cfg(target_os = "linux")]
    fn staging_left_by_a_killed_process_is_removed_by_the_next_run() {
        let parent = tempfile::tempdir().unwrap();
        let p = parent.path();
        let dead = 999_999_999u32; // above any pid_max: no such process
        let me = std::process::id();
        for name in [
            format!(".out.quantizing-{dead}-Ab12"),
            format!(".out.quantizing-{me}-Cd34"),
            ".out.quantizing-1-Ef56".to_string(),
            format!(".other.quantizing-{dead}-Gh78"),
            format!(".out.importing-{dead}-Ij90"),
            "out".to_string(),
        ] {
            std::fs::create_dir(p.join(name)).unwrap();
        }
        std::fs::write(p.join(format!(".out.quantizing-{dead}-file")), b"partial").unwrap();
        std::fs::create_dir(p.join(format!(".out2.replaced-{dead}-Kl12"))).unwrap();
        std::fs::write(p.join(format!(".out2.replaced-{dead}-Kl12/config.json")), b"{}").unwrap();
        let staged = StagedDir::create(&p.join("out2"), "quantizing").unwrap();
        assert!(staged.path().file_name().unwrap().to_str().unwrap().starts_with(&format!(".out2.quantizing-{me}-")));
        drop(staged);
        assert_eq!(remove_stale_staging(p, ".out.quantizing-"), 2);
        let mut names: Vec<String> =
            std::fs::read_dir(p).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
        names.sort();
        let mut want = vec![
            ".out.quantizing-1-Ef56".to_string(),
            format!(".out.quantizing-{me}-Cd34"),
            format!(".other.quantizing-{dead}-Gh78"),
            format!(".out.importing-{dead}-Ij90"),
            "out".to_string(),
        ];
        want.sort();
        assert_eq!(names, want, "only the dead process's `.out.quantizing-` entries go");
    }
}
