//! Reading an strace log (`strace -f -qq -y -xx -s N`): the calls that touch the store file
//! (and the syncs of its directory) and the lines the workload wrote to its acknowledgement file, each with the trace lines at
//! which it started and returned.
//!
//! With `-f`, a call interrupted by another thread's output shows as `NAME(args <unfinished
//! ...>` and later `<... NAME resumed>rest`; the two halves are joined, and the call's `start`
//! and `end` are the two lines. With `-y` every descriptor is printed with its path, with
//! `-xx` every string (paths too) as `\xHH` escapes, so data and paths decode exactly.
//!
//! Anything that could change the store file in a way the crash model does not know (a
//! `write` at the file position, `pwritev`, `sync_file_range`, a shared mapping, a `dup` of its
//! descriptor, a rename) fails the parse rather than being ignored.

use std::collections::HashMap;

/// What a call did to the store file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Change {
    /// `pwrite64(fd, data, len, offset)`.
    Data { offset: u64, data: Vec<u8> },
    /// `ftruncate`, or a `fallocate` that extends the file.
    Resize { len: u64 },
}

/// A change of the store file, and whether it was written through a descriptor opened with
/// `O_DSYNC`/`O_SYNC` (durable when the call returns).
#[derive(Debug, Clone)]
pub struct FileOp {
    pub start: usize,
    pub end: usize,
    pub change: Change,
    pub dsync: bool,
}

/// An `fdatasync`/`fsync` of the store file (through any descriptor: the page cache is the
/// inode's).
#[derive(Debug, Clone, Copy)]
pub struct Barrier {
    pub start: usize,
    pub end: usize,
}

/// One line of the acknowledgement file, and the trace line of its `write`.
#[derive(Debug, Clone)]
pub struct Note {
    pub start: usize,
    pub text: String,
}

/// Everything the crash model needs from one trace.
#[derive(Debug, Default)]
pub struct Trace {
    pub ops: Vec<FileOp>,
    pub barriers: Vec<Barrier>,
    pub notes: Vec<Note>,
    /// Calls on the store file by kind, for the report.
    pub counts: HashMap<String, usize>,
    /// Descriptors of the store file opened with `O_DSYNC`.
    pub dsync_opens: usize,
    /// The line where an `open` with `O_CREAT` of the store file returned, the first time.
    pub created: Option<usize>,
    /// The lines where an `fsync`/`fdatasync` of the store file's directory returned.
    pub dir_syncs: Vec<usize>,
    pub lines: usize,
}

/// Parses `text`, the log of a run that wrote the store file `store` and its notes to `notes`.
pub fn parse(text: &str, store: &str, notes: &str) -> Result<Trace, String> {
    let mut trace = Trace::default();
    let mut unfinished: HashMap<u32, (usize, String)> = HashMap::new();
    // Descriptor -> (path, opened with O_DSYNC). Threads share the table; the child is one
    // process.
    let mut fds: HashMap<i64, (String, bool)> = HashMap::new();
    for (index, line) in text.lines().enumerate() {
        trace.lines = index + 1;
        let (pid, rest) = split_pid(line)?;
        if rest.starts_with("---") || rest.starts_with("+++") {
            continue;
        }
        let (start, call) = if let Some(resumed) = rest.strip_prefix("<... ") {
            let (_, tail) = resumed
                .split_once(" resumed>")
                .ok_or_else(|| format!("line {index}: bad resumption: {line}"))?;
            let (start, head) = unfinished
                .remove(&pid)
                .ok_or_else(|| format!("line {index}: resumption without a start: {line}"))?;
            (start, format!("{head}{tail}"))
        } else if let Some(head) = rest.strip_suffix(" <unfinished ...>") {
            unfinished.insert(pid, (index, head.to_owned()));
            continue;
        } else {
            (index, rest.to_owned())
        };
        let call = Call::parse(&call).map_err(|e| format!("line {index}: {e}: {line}"))?;
        trace.record(call, (start, index), (store, notes), &mut fds)?;
    }
    Ok(trace)
}

fn split_pid(line: &str) -> Result<(u32, &str), String> {
    let (pid, rest) = line
        .split_once(' ')
        .ok_or_else(|| format!("no pid: {line}"))?;
    let pid = pid.parse().map_err(|_| format!("no pid: {line}"))?;
    Ok((pid, rest.trim_start()))
}

/// One complete call: its name, its arguments as printed, and its return value.
#[derive(Debug)]
struct Call {
    name: String,
    args: Vec<String>,
    ret: String,
}

impl Call {
    fn parse(text: &str) -> Result<Call, String> {
        let open = text.find('(').ok_or("no argument list")?;
        // strace pads short calls: `mmap(...)          = 0x7f...`.
        let equals = text.rfind(" = ").ok_or("no return value")?;
        let close = text[..equals]
            .trim_end()
            .strip_suffix(')')
            .ok_or("no end of the argument list")?
            .len();
        let name = text[..open].to_owned();
        let args = split_args(&text[open + 1..close]);
        let ret = text[equals + 3..].to_owned();
        Ok(Call { name, args, ret })
    }

    fn arg(&self, i: usize) -> Result<&str, String> {
        self.args
            .get(i)
            .map(String::as_str)
            .ok_or_else(|| format!("{}: no argument {i}", self.name))
    }

    /// The return value as a number; `None` for a failed call (`-1 ENOENT (...)`).
    fn ret_value(&self) -> Option<i64> {
        let first = self.ret.split(' ').next()?;
        let value = first.split('<').next()?.parse().ok()?;
        (value >= 0).then_some(value)
    }
}

/// Splits at top-level commas: `-xx` leaves no comma or quote inside a string, but flags in
/// braces or brackets (`{...}`, `[...]`) and paths in `<...>` may hold commas.
fn split_args(text: &str) -> Vec<String> {
    let mut args = Vec::new();
    let (mut depth, mut quoted, mut current) = (0i32, false, String::new());
    for c in text.chars() {
        match c {
            '"' => quoted = !quoted,
            '{' | '[' | '<' | '(' if !quoted => depth += 1,
            '}' | ']' | '>' | ')' if !quoted => depth -= 1,
            ',' if !quoted && depth == 0 => {
                args.push(current.trim().to_owned());
                current.clear();
                continue;
            }
            _ => {}
        }
        current.push(c);
    }
    if !current.trim().is_empty() {
        args.push(current.trim().to_owned());
    }
    args
}

/// `\x2f\x74` -> bytes.
fn unhex(text: &str) -> Result<Vec<u8>, String> {
    let mut out = Vec::with_capacity(text.len() / 4);
    let bytes = text.as_bytes();
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] != b'\\' || bytes.get(i + 1) != Some(&b'x') || i + 4 > bytes.len() {
            return Err(format!("not a -xx string: {text:.40}"));
        }
        let pair = std::str::from_utf8(&bytes[i + 2..i + 4]).map_err(|e| e.to_string())?;
        out.push(u8::from_str_radix(pair, 16).map_err(|e| e.to_string())?);
        i += 4;
    }
    Ok(out)
}

/// A quoted `-xx` string argument; a string strace cut short (`"..."...`) is an error.
fn string(arg: &str) -> Result<Vec<u8>, String> {
    if arg.ends_with("\"...") {
        return Err("a string cut short: raise strace's -s".to_owned());
    }
    let inner = arg
        .strip_prefix('"')
        .and_then(|a| a.strip_suffix('"'))
        .ok_or_else(|| format!("not a string: {arg:.40}"))?;
    unhex(inner)
}

/// `3<\x2f...>` -> (3, path).
fn fd(arg: &str) -> Result<(i64, String), String> {
    let (number, path) = arg
        .split_once('<')
        .ok_or("a descriptor without a path (-y)")?;
    let number = number
        .parse()
        .map_err(|_| format!("bad descriptor {arg:.40}"))?;
    let path = path.strip_suffix('>').ok_or("bad descriptor path")?;
    // A deleted file shows as `path (deleted)`; strace prints the path itself escaped.
    let path = path.split(" (deleted)").next().unwrap_or(path);
    Ok((number, decode_path(path)?))
}

fn decode_path(path: &str) -> Result<String, String> {
    if path.starts_with("\\x") {
        String::from_utf8(unhex(path)?).map_err(|e| e.to_string())
    } else {
        // pipe:[123], socket:[..], anon_inode:... are printed as they are.
        Ok(path.to_owned())
    }
}

fn number(arg: &str) -> Result<u64, String> {
    arg.parse().map_err(|_| format!("not a number: {arg:.40}"))
}

impl Trace {
    /// `span`: the lines where the call started and returned; `files`: the store file's path
    /// and the notes file's.
    fn record(
        &mut self,
        call: Call,
        span: (usize, usize),
        files: (&str, &str),
        fds: &mut HashMap<i64, (String, bool)>,
    ) -> Result<(), String> {
        let store = files.0;
        let Some(ret) = call.ret_value() else {
            // A failed call changed nothing; one on the store file is not expected at all.
            if call.args.iter().any(|a| a.contains(&hex_path(store))) {
                return Err(format!(
                    "{} on the store file failed: {}",
                    call.name, call.ret
                ));
            }
            return Ok(());
        };
        match call.name.as_str() {
            "openat" | "open" | "creat" => {
                let flags = if call.name == "openat" {
                    call.arg(2)?
                } else {
                    call.args.get(1).map_or("", String::as_str)
                };
                let (fd_number, path) = fd(&call.ret)?;
                let dsync = flags.contains("O_DSYNC") || flags.contains("O_SYNC");
                if path == store {
                    *self.counts.entry("open".to_owned()).or_default() += 1;
                    self.dsync_opens += usize::from(dsync);
                    if flags.contains("O_CREAT") || call.name == "creat" {
                        self.created.get_or_insert(span.1);
                    }
                }
                fds.insert(fd_number, (path, dsync));
            }
            "close" => {
                let (number, _) = fd(call.arg(0)?)?;
                fds.remove(&number);
            }
            _ => self.record_io(&call, span, ret, files, fds)?,
        }
        Ok(())
    }

    fn record_io(
        &mut self,
        call: &Call,
        (start, end): (usize, usize),
        ret: i64,
        (store, notes): (&str, &str),
        fds: &HashMap<i64, (String, bool)>,
    ) -> Result<(), String> {
        let first = call.args.first().map_or("", String::as_str);
        let Ok((number, path)) = fd(first) else {
            // mmap of anonymous memory (fd -1) and the like.
            if call.name == "mmap" && call.args.iter().any(|a| a.contains(&hex_path(store))) {
                return Err("the store file is mapped".to_owned());
            }
            return Ok(());
        };
        if call.name == "write" && path == notes {
            let text = String::from_utf8(string(call.arg(1)?)?).map_err(|e| e.to_string())?;
            for line in text.lines() {
                self.notes.push(Note {
                    start,
                    text: line.to_owned(),
                });
            }
            return Ok(());
        }
        let directory = std::path::Path::new(store).parent();
        if directory.is_some_and(|d| d.as_os_str() == path.as_str())
            && matches!(call.name.as_str(), "fsync" | "fdatasync")
        {
            self.dir_syncs.push(end);
        }
        if path != store {
            if call.name == "mmap" && call.args.iter().any(|a| a.contains(&hex_path(store))) {
                return Err("the store file is mapped".to_owned());
            }
            return Ok(());
        }
        *self.counts.entry(call.name.clone()).or_default() += 1;
        let dsync = match fds.get(&number) {
            Some((known, dsync)) if *known == path => *dsync,
            _ => {
                return Err(format!(
                    "descriptor {number} of the store file was never opened"
                ));
            }
        };
        let change = match call.name.as_str() {
            "pwrite64" => {
                let mut data = string(call.arg(1)?)?;
                data.truncate(ret as usize);
                Change::Data {
                    offset: number_arg(call, 3)?,
                    data,
                }
            }
            "ftruncate" => Change::Resize {
                len: number_arg(call, 1)?,
            },
            "fallocate" if call.arg(1)? == "0" => Change::Resize {
                len: number_arg(call, 2)? + number_arg(call, 3)?,
            },
            "fdatasync" | "fsync" => {
                self.barriers.push(Barrier { start, end });
                return Ok(());
            }
            other => return Err(format!("{other} on the store file is not modelled")),
        };
        self.ops.push(FileOp {
            start,
            end,
            change,
            dsync,
        });
        Ok(())
    }

    /// The calls on the store file, for the report: `pwrite64 12 (3 O_DSYNC), ...`.
    pub fn summary(&self) -> String {
        let mut counts: Vec<_> = self.counts.iter().collect();
        counts.sort();
        let dsync_writes = self.ops.iter().filter(|op| op.dsync).count();
        let list: Vec<String> = counts.iter().map(|(k, v)| format!("{k} {v}")).collect();
        format!(
            "{} ({dsync_writes} writes through the O_DSYNC descriptor)",
            list.join(", ")
        )
    }
}

fn number_arg(call: &Call, i: usize) -> Result<u64, String> {
    number(call.arg(i)?)
}

fn hex_path(path: &str) -> String {
    path.bytes().map(|b| format!("\\x{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn joins_unfinished_calls_and_decodes_data() {
        let store = "/s";
        let log = "1 openat(AT_FDCWD<\\x2f>, \"\\x2f\\x73\", O_RDWR|O_CLOEXEC) = 3<\\x2f\\x73>\n\
                   1 openat(AT_FDCWD<\\x2f>, \"\\x2f\\x73\", O_WRONLY|O_DSYNC|O_CLOEXEC) = 4<\\x2f\\x73>\n\
                   2 pwrite64(4<\\x2f\\x73>, \"\\x01\\x2c\\x22\", 3, 8192 <unfinished ...>\n\
                   1 pwrite64(3<\\x2f\\x73>, \"\\x00\", 1, 0) = 1\n\
                   2 <... pwrite64 resumed>) = 3\n\
                   1 fdatasync(3<\\x2f\\x73>) = 0\n";
        let trace = parse(log, store, "/n").expect("parse");
        // In the order the calls returned.
        assert_eq!(trace.ops.len(), 2);
        assert_eq!((trace.ops[0].start, trace.ops[0].end), (3, 3));
        assert!(!trace.ops[0].dsync);
        assert_eq!((trace.ops[1].start, trace.ops[1].end), (2, 4));
        assert!(trace.ops[1].dsync);
        assert_eq!(
            trace.ops[1].change,
            Change::Data {
                offset: 8192,
                data: vec![1, b',', b'"']
            }
        );
        assert_eq!(trace.barriers.len(), 1);
    }
}
