//! Chat templates: HF's Jinja dialect on minijinja.
//!
//! transformers renders `chat_template` with jinja2 (`trim_blocks`, `lstrip_blocks`, the
//! `loopcontrols` extension), a `raise_exception` function, a `strftime_now` function, a `tojson`
//! filter that is Python's `json.dumps(ensure_ascii=False)`, and Python semantics for string
//! methods and for printing values. This module sets minijinja up the same way:
//! minijinja-contrib's `pycompat` supplies `.strip()`, `.startswith()`, `.split()`, `.items()` and
//! the other Python methods, and a formatter prints `True`/`False`/`None` and lists and dicts the
//! way Python's `str()` does.
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use minijinja::value::{Kwargs, Value, ValueKind};
use minijinja::{Environment, Error as JinjaError, ErrorKind, Output, State};

use super::{ChatMessage, tok_err};
use crate::Result;

const TEMPLATE_NAME: &str = "chat_template";

/// The work limit of one rendering, in minijinja fuel (about one unit per template
/// instruction): a model directory is untrusted input, and a template whose loops never end
/// (or nest past any real use) stops with an error instead of hanging `generate` or a
/// server's handler. Real templates spend a few hundred units per message.
pub const RENDER_FUEL: u64 = 20_000_000;

/// A compiled chat template and where it came from.
pub(crate) struct ChatTemplate {
    pub(crate) source: String,
    pub(crate) origin: PathBuf,
    fuel: u64,
    env: std::result::Result<Environment<'static>, String>,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("origin", &self.origin)
            .field("chars", &self.source.len())
            .field("fuel", &self.fuel)
            .field("compiles", &self.env.is_ok())
            .finish()
    }
}

impl ChatTemplate {
    /// Compiles `source` with a work limit of `fuel` ([`RENDER_FUEL`] for a model's own); a
    /// syntax error is kept and reported when the template is applied, so a tokenizer with an
    /// unusable template still encodes and decodes.
    pub(crate) fn new(source: String, origin: PathBuf, fuel: u64) -> Self {
        let mut env = environment();
        env.set_fuel(Some(fuel));
        let env = match env.add_template_owned(TEMPLATE_NAME, source.clone()) {
            Ok(()) => Ok(env),
            Err(e) => Err(describe(&e)),
        };
        Self { source, origin, fuel, env }
    }

    /// The work limit of one rendering, in minijinja fuel.
    pub(crate) fn fuel(&self) -> u64 {
        self.fuel
    }

    /// The compile error of the template, if it has one.
    pub(crate) fn compile_error(&self) -> Option<&str> {
        self.env.as_ref().err().map(String::as_str)
    }

    pub(crate) fn render(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
        specials: &[(&str, Option<&str>)],
        extra: &serde_json::Map<String, serde_json::Value>,
    ) -> Result<String> {
        let env =
            self.env.as_ref().map_err(|e| tok_err(&self.origin, format!("chat template does not compile: {e}")))?;
        // Messages go in as serde structs (not through serde_json::Value, whose maps are sorted),
        // so `messages | tojson` keeps Python's key order: role, content.
        let mut ctx: BTreeMap<String, Value> =
            extra.iter().map(|(k, v)| (k.clone(), Value::from_serialize(v))).collect();
        ctx.insert("messages".into(), Value::from_serialize(messages));
        ctx.insert("add_generation_prompt".into(), add_generation_prompt.into());
        for (name, value) in specials {
            if let Some(v) = value {
                ctx.entry(name.to_string()).or_insert_with(|| Value::from(*v));
            }
        }
        let tmpl = env.get_template(TEMPLATE_NAME).map_err(|e| tok_err(&self.origin, describe(&e)))?;
        tmpl.render(Value::from_iter(ctx)).map_err(|e| {
            let message = match e.kind() {
                ErrorKind::OutOfFuel => format!(
                    "chat template: rendering ran past its work limit of {} instructions \
                     (a loop that never ends, or loops nested too deep)",
                    self.fuel
                ),
                _ => format!("chat template: {}", describe(&e)),
            };
            tok_err(&self.origin, message)
        })
    }
}

fn describe(e: &JinjaError) -> String {
    let mut s = e.to_string();
    let mut source = std::error::Error::source(e);
    while let Some(inner) = source {
        let _ = write!(s, ": {inner}");
        source = inner.source();
    }
    s
}

/// The environment transformers' chat templates expect.
pub(crate) fn environment() -> Environment<'static> {
    let mut env = Environment::new();
    env.set_trim_blocks(true);
    env.set_lstrip_blocks(true);
    env.set_keep_trailing_newline(false);
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.add_function("raise_exception", raise_exception);
    env.add_function("strftime_now", strftime_now);
    env.add_filter("tojson", tojson);
    env.set_formatter(python_formatter);
    env
}

fn raise_exception(message: String) -> std::result::Result<Value, JinjaError> {
    Err(JinjaError::new(ErrorKind::InvalidOperation, message))
}

/// Prints values as Python's `str()` does: `True`, `False`, `None`, `['a', 1]`, `{'k': 'v'}`.
fn python_formatter(out: &mut Output, state: &State, value: &Value) -> std::result::Result<(), JinjaError> {
    match value.kind() {
        ValueKind::None | ValueKind::Bool | ValueKind::Seq | ValueKind::Map | ValueKind::Number => {
            let mut s = String::new();
            py_repr(value, &mut s);
            out.write_str(&s).map_err(|e| JinjaError::new(ErrorKind::WriteFailure, e.to_string()))
        }
        _ => minijinja::escape_formatter(out, state, value),
    }
}

fn py_str_repr(s: &str, out: &mut String) {
    let quote = if s.contains('\'') && !s.contains('"') { '"' } else { '\'' };
    out.push(quote);
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c == quote => {
                out.push('\\');
                out.push(c);
            }
            c if (c as u32) < 0x20 || c as u32 == 0x7f => {
                let _ = write!(out, "\\x{:02x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push(quote);
}

/// Python's `repr()` of a float (shortest round-trip digits, exponent outside 1e-4..1e16).
fn py_float(x: f64, out: &mut String) {
    if x.is_nan() {
        out.push_str("nan");
    } else if x.is_infinite() {
        out.push_str(if x > 0.0 { "inf" } else { "-inf" });
    } else {
        let sci = format!("{x:e}");
        let (mantissa, exp) = sci.split_once('e').unwrap_or((&sci, "0"));
        let exp: i32 = exp.parse().unwrap_or(0);
        if x != 0.0 && !(-4..16).contains(&exp) {
            let _ = write!(out, "{mantissa}e{}{:02}", if exp < 0 { '-' } else { '+' }, exp.abs());
        } else {
            let s = format!("{x}");
            out.push_str(&s);
            if !s.contains('.') {
                out.push_str(".0");
            }
        }
    }
}

fn py_repr(value: &Value, out: &mut String) {
    match value.kind() {
        ValueKind::Undefined | ValueKind::None => out.push_str("None"),
        ValueKind::Bool => out.push_str(if value.is_true() { "True" } else { "False" }),
        ValueKind::Number if !value.is_integer() => py_float(f64::try_from(value.clone()).unwrap_or(f64::NAN), out),
        ValueKind::String => py_str_repr(value.as_str().unwrap_or_default(), out),
        ValueKind::Seq | ValueKind::Iterable => {
            out.push('[');
            for (i, item) in value.try_iter().into_iter().flatten().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                py_repr(&item, out);
            }
            out.push(']');
        }
        ValueKind::Map => {
            out.push('{');
            for (i, key) in value.try_iter().into_iter().flatten().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                py_repr(&key, out);
                out.push_str(": ");
                py_repr(&value.get_item(&key).unwrap_or_default(), out);
            }
            out.push('}');
        }
        _ => {
            let _ = write!(out, "{value}");
        }
    }
}

struct JsonStyle {
    indent: Option<String>,
    item_sep: String,
    key_sep: String,
    sort_keys: bool,
    ensure_ascii: bool,
}

fn json_str(s: &str, ensure_ascii: bool, out: &mut String) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c if ensure_ascii && !c.is_ascii() => {
                let mut buf = [0u16; 2];
                for unit in c.encode_utf16(&mut buf) {
                    let _ = write!(out, "\\u{unit:04x}");
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

fn json_dump(value: &Value, style: &JsonStyle, depth: usize, out: &mut String) -> std::result::Result<(), JinjaError> {
    let newline = |out: &mut String, depth: usize| {
        if let Some(ind) = &style.indent {
            out.push('\n');
            for _ in 0..depth {
                out.push_str(ind);
            }
        }
    };
    match value.kind() {
        ValueKind::Undefined | ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if value.is_true() { "true" } else { "false" }),
        ValueKind::Number if value.is_integer() => {
            let _ = write!(out, "{value}");
        }
        ValueKind::Number => {
            let x = f64::try_from(value.clone()).unwrap_or(f64::NAN);
            if x.is_nan() {
                out.push_str("NaN");
            } else if x.is_infinite() {
                out.push_str(if x > 0.0 { "Infinity" } else { "-Infinity" });
            } else {
                py_float(x, out);
            }
        }
        ValueKind::String => json_str(value.as_str().unwrap_or_default(), style.ensure_ascii, out),
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = value.try_iter()?.collect();
            if items.is_empty() {
                out.push_str("[]");
                return Ok(());
            }
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(&style.item_sep);
                }
                newline(out, depth + 1);
                json_dump(item, style, depth + 1, out)?;
            }
            newline(out, depth);
            out.push(']');
        }
        ValueKind::Map => {
            let mut keys: Vec<Value> = value.try_iter()?.collect();
            if style.sort_keys {
                keys.sort();
            }
            if keys.is_empty() {
                out.push_str("{}");
                return Ok(());
            }
            out.push('{');
            for (i, key) in keys.iter().enumerate() {
                if i > 0 {
                    out.push_str(&style.item_sep);
                }
                newline(out, depth + 1);
                match key.as_str() {
                    Some(k) => json_str(k, style.ensure_ascii, out),
                    None => {
                        let mut k = String::new();
                        json_dump(key, style, depth + 1, &mut k)?;
                        json_str(k.trim_matches('"'), style.ensure_ascii, out);
                    }
                }
                out.push_str(&style.key_sep);
                json_dump(&value.get_item(key)?, style, depth + 1, out)?;
            }
            newline(out, depth);
            out.push('}');
        }
        other => {
            return Err(JinjaError::new(ErrorKind::InvalidOperation, format!("tojson: cannot serialize a {other}")));
        }
    }
    Ok(())
}

/// HF's `tojson`: `json.dumps(value, ensure_ascii=False, indent=indent, separators=separators,
/// sort_keys=sort_keys)`.
fn tojson(value: Value, kwargs: Kwargs) -> std::result::Result<Value, JinjaError> {
    let indent: Option<Value> = kwargs.get("indent")?;
    let indent = match indent {
        None => None,
        Some(v) if v.is_none() => None,
        Some(v) => match (v.as_i64(), v.as_str()) {
            (Some(n), _) => Some(" ".repeat(n.max(0) as usize)),
            (_, Some(s)) => Some(s.to_string()),
            _ => return Err(JinjaError::new(ErrorKind::InvalidOperation, "tojson: indent must be an int or string")),
        },
    };
    let separators: Option<Value> = kwargs.get("separators")?;
    let (item_sep, key_sep) = match separators.filter(|v| !v.is_none()) {
        Some(v) => {
            let parts: Vec<String> =
                v.try_iter()?.map(|p| p.as_str().map(str::to_string).unwrap_or_else(|| p.to_string())).collect();
            match parts.as_slice() {
                [a, b] => (a.clone(), b.clone()),
                _ => return Err(JinjaError::new(ErrorKind::InvalidOperation, "tojson: separators must be a pair")),
            }
        }
        None if indent.is_some() => (",".into(), ": ".into()),
        None => (", ".into(), ": ".into()),
    };
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    let ensure_ascii: Option<bool> = kwargs.get("ensure_ascii")?;
    kwargs.assert_all_used()?;
    let style = JsonStyle {
        indent,
        item_sep,
        key_sep,
        sort_keys: sort_keys.unwrap_or(false),
        ensure_ascii: ensure_ascii.unwrap_or(false),
    };
    let mut out = String::new();
    json_dump(&value, &style, 0, &mut out)?;
    Ok(Value::from_safe_string(out))
}

/// `strftime_now(format)`: the current time formatted like Python's `strftime` (UTC; supports
/// `%Y %y %m %d %e %j %H %I %M %S %p %b %B %a %A %%`, other directives are copied).
fn strftime_now(format: String) -> std::result::Result<Value, JinjaError> {
    let secs =
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs() as i64).unwrap_or(0);
    Ok(Value::from(strftime(secs, &format)))
}

/// Formats `secs` since the Unix epoch (UTC) with a subset of Python's `strftime` directives.
pub(crate) fn strftime(secs: i64, format: &str) -> String {
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    const DAYS: [&str; 7] = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"];
    let days = secs.div_euclid(86_400);
    let tod = secs.rem_euclid(86_400);
    let (h, mi, s) = (tod / 3600, tod % 3600 / 60, tod % 60);
    // Howard Hinnant's days-to-civil.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy_mar = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy_mar + 2) / 153;
    let d = doy_mar - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    let leap = (y % 4 == 0 && y % 100 != 0) || y % 400 == 0;
    let cum = [0, 31, 59, 90, 120, 151, 181, 212, 243, 273, 304, 334];
    let yday = cum[(m - 1) as usize] + d + i64::from(leap && m > 2);
    let weekday = (days + 3).rem_euclid(7) as usize; // 1970-01-01 was a Thursday
    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let _ = match chars.next() {
            Some('Y') => write!(out, "{y}"),
            Some('y') => write!(out, "{:02}", y.rem_euclid(100)),
            Some('m') => write!(out, "{m:02}"),
            Some('d') => write!(out, "{d:02}"),
            Some('e') => write!(out, "{d:2}"),
            Some('j') => write!(out, "{yday:03}"),
            Some('H') => write!(out, "{h:02}"),
            Some('I') => write!(out, "{:02}", if h % 12 == 0 { 12 } else { h % 12 }),
            Some('M') => write!(out, "{mi:02}"),
            Some('S') => write!(out, "{s:02}"),
            Some('p') => write!(out, "{}", if h < 12 { "AM" } else { "PM" }),
            Some('b') => write!(out, "{}", &MONTHS[(m - 1) as usize][..3]),
            Some('B') => write!(out, "{}", MONTHS[(m - 1) as usize]),
            Some('a') => write!(out, "{}", &DAYS[weekday][..3]),
            Some('A') => write!(out, "{}", DAYS[weekday]),
            Some('%') => write!(out, "%"),
            Some(other) => write!(out, "%{other}"),
            None => write!(out, "%"),
        };
    }
    out
}

/// The chat template source of a model directory, and the file it came from: `chat_template.jinja`
/// (the transformers 5 / mlx-lm layout), else `tokenizer_config.json` `chat_template` (a string,
/// or a list of `{name, template}` from which `default` is taken), else `chat_template.json`.
pub(crate) fn find_template(
    dir: &Path,
    config: Option<&serde_json::Value>,
    config_path: &Path,
) -> Result<Option<(String, PathBuf)>> {
    let jinja = dir.join("chat_template.jinja");
    if jinja.is_file() {
        let text = std::fs::read_to_string(&jinja).map_err(|e| tok_err(&jinja, format!("cannot read: {e}")))?;
        return Ok(Some((text, jinja)));
    }
    if let Some(t) = config.and_then(|c| c.get("chat_template")) {
        return template_field(t, config_path).map(|t| t.map(|t| (t, config_path.to_path_buf())));
    }
    let json = dir.join("chat_template.json");
    if json.is_file() {
        let v = super::read_json(&json)?.unwrap_or_default();
        if let Some(t) = v.get("chat_template") {
            return template_field(t, &json).map(|t| t.map(|t| (t, json.clone())));
        }
    }
    Ok(None)
}

fn template_field(t: &serde_json::Value, path: &Path) -> Result<Option<String>> {
    match t {
        serde_json::Value::Null => Ok(None),
        serde_json::Value::String(s) => Ok(Some(s.clone())),
        serde_json::Value::Array(list) => {
            let named = |name: &str| {
                list.iter()
                    .find(|e| e.get("name").and_then(|n| n.as_str()) == Some(name))
                    .and_then(|e| e.get("template"))
            };
            match named("default") {
                Some(serde_json::Value::String(s)) => Ok(Some(s.clone())),
                _ => {
                    let names: Vec<&str> = list.iter().filter_map(|e| e.get("name").and_then(|n| n.as_str())).collect();
                    Err(tok_err(path, format!("`chat_template` lists templates {names:?} but none named \"default\"")))
                }
            }
        }
        _ => Err(tok_err(path, "`chat_template` is neither a string nor a list of {name, template}")),
    }
}
