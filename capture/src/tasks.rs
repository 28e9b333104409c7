//! Built-in prompt tasks, so anyone can make the same traces.
//!
//! - `passkey:length=N,depth=D`: a pass key sentence (the `needle` span) at
//!   relative depth D inside deterministic filler text, then the question
//!   (the `question` span); about N prompt tokens.
//! - `multifact:length=N,facts=K`: K codes spread evenly through the filler
//!   (spans `fact0` ..), the question asks for one of them (that fact is also
//!   the `needle` span).
//! - `file:PATH`: plain text from a file.
//!
//! Spans are recorded in token positions of the final (templated) prompt.

use std::ops::Range;

use crate::{CaptureError, Model};

/// A task's prompt: the user text and named byte ranges in it.
#[derive(Clone, Debug)]
pub struct TaskPrompt {
    pub text: String,
    pub spans: Vec<(String, Range<usize>)>,
    /// Description recorded as the manifest's prompt source.
    pub source: String,
}

const FILLER: &[&str] = &[
    "The grass is green and the sky is blue.",
    "The sun rises in the east and sets in the west.",
    "A river runs past the old mill at the edge of the village.",
    "Children played in the fields until the evening bell.",
    "The market opens early on the first day of every week.",
    "Rain fell softly on the roofs of the quiet town.",
    "The baker sells fresh bread before the shops open.",
    "Boats drift slowly along the canal in the summer heat.",
];

/// Deterministic filler of at least `n_tokens` tokens, as whole sentences.
fn filler(model: &Model, n_tokens: usize) -> Result<Vec<String>, CaptureError> {
    let mut out = Vec::new();
    let mut count = 0;
    let mut i = 0usize;
    while count < n_tokens {
        let s = FILLER[(i * 5 + i / FILLER.len()) % FILLER.len()].to_string();
        count += model.tokenizer.encode_piece(&format!(" {s}"))?.len();
        out.push(s);
        i += 1;
    }
    Ok(out)
}

/// The longest task prompt `--task` builds, in tokens (2^24, far beyond
/// any model's context; a longer one would only exhaust memory building filler).
pub const MAX_TASK_LENGTH: usize = 1 << 24;

/// A parsed `--task` spec.
#[derive(Clone, Debug, PartialEq)]
pub enum TaskSpec {
    /// `file:PATH`: plain text from a file.
    File(String),
    /// `passkey:length=N,depth=D`.
    Passkey { length: usize, depth: f64 },
    /// `multifact:length=N,facts=K`.
    Multifact { length: usize, facts: usize },
}

impl TaskSpec {
    /// Parse `name:key=value,...` (or `file:PATH`) without building anything.
    pub fn parse(spec: &str) -> Result<TaskSpec, CaptureError> {
        let (name, rest) = spec.split_once(':').unwrap_or((spec, ""));
        let bad = |m: String| CaptureError::InvalidOption(format!("--task {spec}: {m}"));
        if name == "file" {
            return Ok(TaskSpec::File(rest.to_string()));
        }
        if !matches!(name, "passkey" | "multifact") {
            return Err(bad(format!(
                "unknown task `{name}` (known: passkey, multifact, file:PATH)"
            )));
        }
        let mut length = 1024usize;
        let mut depth = 0.5f64;
        let mut facts = 4usize;
        for kv in rest.split(',').filter(|s| !s.is_empty()) {
            let (k, v) = kv
                .split_once('=')
                .ok_or_else(|| bad(format!("`{kv}` is not key=value")))?;
            match (name, k) {
                (_, "length") => {
                    length = v
                        .parse()
                        .ok()
                        .filter(|n| *n <= MAX_TASK_LENGTH)
                        .ok_or_else(|| {
                            bad(format!(
                                "length `{v}` is not a number of tokens up to {MAX_TASK_LENGTH}"
                            ))
                        })?
                }
                ("passkey", "depth") => {
                    depth = v
                        .parse()
                        .ok()
                        .filter(|d: &f64| (0.0..=1.0).contains(d))
                        .ok_or_else(|| bad(format!("depth `{v}` must lie in [0, 1]")))?
                }
                ("multifact", "facts") => {
                    facts = v
                        .parse()
                        .ok()
                        .filter(|f| *f >= 1)
                        .ok_or_else(|| bad(format!("facts `{v}` must be a positive number")))?
                }
                _ => {
                    return Err(bad(format!(
                        "unknown parameter `{k}` (passkey: length, depth; multifact: length, facts)"
                    )))
                }
            }
        }
        if name == "passkey" {
            return Ok(TaskSpec::Passkey { length, depth });
        }
        if facts > length {
            return Err(bad(format!(
                "{facts} facts cannot fit in a prompt of {length} tokens (each fact takes several); use fewer facts or a longer length"
            )));
        }
        Ok(TaskSpec::Multifact { length, facts })
    }
}

/// Parse `name:key=value,...` task specs and build the prompt.
pub fn build(spec: &str, model: &Model) -> Result<TaskPrompt, CaptureError> {
    let task = TaskSpec::parse(spec)?;
    let context = model.llama.cfg.context_length;
    if let TaskSpec::Passkey { length, .. } | TaskSpec::Multifact { length, .. } = task {
        if length > context {
            // also keeps the filler loop finite: length=100000000000 ran unbounded
            return Err(CaptureError::InvalidOption(format!(
                "--task {spec}: length={length} is more than the model's context of {context} tokens (and the prompt must fit it); use length={context} or less"
            )));
        }
    }
    match task {
        TaskSpec::File(path) => {
            let text = crate::read_text_file(std::path::Path::new(&path), "prompt file")?;
            Ok(TaskPrompt {
                text,
                spans: vec![],
                source: format!("task:file:{path}"),
            })
        }
        TaskSpec::Passkey { length, depth } => passkey(model, length, depth).map(|mut t| {
            t.source = format!("task:passkey:length={length},depth={depth}");
            t
        }),
        TaskSpec::Multifact { length, facts } => multifact(model, length, facts).map(|mut t| {
            t.source = format!("task:multifact:length={length},facts={facts}");
            t
        }),
    }
}

/// Join sentences, inserting `inserts` (text, span name) before sentence index
/// i (after the last sentence when i is past the end).
fn assemble(
    head: &str,
    body: &[String],
    inserts: &[(usize, String, String)],
    tail: &str,
    tail_name: &str,
) -> TaskPrompt {
    let mut text = String::from(head);
    let mut spans = Vec::new();
    for (i, s) in body.iter().enumerate() {
        for (at, ins, name) in inserts.iter().filter(|x| x.0 == i) {
            let _ = at;
            text.push(' ');
            let start = text.len();
            text.push_str(ins);
            spans.push((name.clone(), start..text.len()));
        }
        text.push(' ');
        text.push_str(s);
    }
    for (_, ins, name) in inserts.iter().filter(|x| x.0 >= body.len()) {
        text.push(' ');
        let start = text.len();
        text.push_str(ins);
        spans.push((name.clone(), start..text.len()));
    }
    text.push(' ');
    let start = text.len();
    text.push_str(tail);
    spans.push((tail_name.to_string(), start..text.len()));
    TaskPrompt {
        text,
        spans,
        source: String::new(),
    }
}

/// A length whose filler is empty cannot hold the task's text where the task
/// puts it: refuse it with the smallest length that can.
fn too_short(task: &str, length: usize, fixed: usize, body: &[String]) -> Result<(), CaptureError> {
    if body.is_empty() {
        return Err(CaptureError::InvalidOption(format!(
            "--task {task}:length={length}: the task's own text is {fixed} tokens, so a prompt of {length} tokens cannot hold it with any filler; use length={} or more",
            fixed + 3
        )));
    }
    Ok(())
}

fn passkey(model: &Model, length: usize, depth: f64) -> Result<TaskPrompt, CaptureError> {
    let head = "There is a pass key hidden in the text below. Find it and remember it.";
    let needle = "The pass key is 68142. Remember it: 68142 is the pass key.";
    let question = "What is the pass key?";
    let fixed = model
        .tokenizer
        .encode(&format!("{head} {needle} {question}"))?
        .len();
    let body = filler(model, length.saturating_sub(fixed + 2))?;
    too_short("passkey", length, fixed, &body)?;
    let at = ((body.len() as f64) * depth).round() as usize;
    Ok(assemble(
        head,
        &body,
        &[(at, needle.into(), "needle".into())],
        question,
        "question",
    ))
}

fn multifact(model: &Model, length: usize, facts: usize) -> Result<TaskPrompt, CaptureError> {
    const DOORS: &[&str] = &[
        "red", "blue", "green", "yellow", "black", "white", "silver", "golden",
    ];
    let head = "Several doors have secret codes, given in the text below. Remember every code.";
    let fact = |i: usize| {
        format!(
            "The secret code of the {} door is {}.",
            DOORS[i % DOORS.len()],
            4821 + 1117 * i
        )
    };
    let ask = facts / 2;
    let question = format!(
        "What is the secret code of the {} door?",
        DOORS[ask % DOORS.len()]
    );
    let fixed: usize = model.tokenizer.encode(&format!("{head} {question}"))?.len()
        + (0..facts)
            .map(|i| model.tokenizer.encode_piece(&fact(i)).map(|v| v.len()))
            .sum::<Result<usize, _>>()?;
    let body = filler(model, length.saturating_sub(fixed + 2))?;
    too_short("multifact", length, fixed, &body)?;
    let inserts: Vec<(usize, String, String)> = (0..facts)
        .map(|i| {
            (
                (i + 1) * body.len() / (facts + 1),
                fact(i),
                format!("fact{i}"),
            )
        })
        .collect();
    let mut t = assemble(head, &body, &inserts, &question, "question");
    let needle = t
        .spans
        .iter()
        .find(|s| s.0 == format!("fact{ask}"))
        .map(|s| s.1.clone())
        .ok_or_else(|| {
            CaptureError::InvalidOption(format!("--task multifact: fact {ask} was not placed"))
        })?;
    t.spans.push(("needle".into(), needle));
    Ok(t)
}

/// Token positions `[start, end)` covering byte range `r` of the encoded text.
pub fn token_span(offsets: &[(usize, usize)], r: &Range<usize>) -> Option<Range<usize>> {
    let start = offsets.iter().position(|o| o.1 > r.start)?;
    let end = offsets.iter().rposition(|o| o.0 < r.end)? + 1;
    (start < end).then_some(start..end)
}

/// Token ids, token-position spans and source of a task prompt, after the
/// chat template when `chat`.
pub fn prepare(
    spec: &str,
    model: &Model,
    chat: bool,
) -> Result<(Vec<u32>, Vec<kvreplay_traces::Span>, String), CaptureError> {
    let t = build(spec, model)?;
    let (rendered, base) = if chat {
        let r = model.tokenizer.apply_chat_template(&t.text)?;
        let base = r.find(&t.text).ok_or_else(|| {
            CaptureError::InvalidOption(format!(
                "--task {spec}: the chat template changed the prompt text; capture without --chat"
            ))
        })?;
        (r, base)
    } else {
        (t.text.clone(), 0)
    };
    let (ids, offsets) = if chat {
        model.tokenizer.encode_chat(&rendered)?
    } else {
        model.tokenizer.encode_with_offsets(&rendered)?
    };
    let spans = t
        .spans
        .iter()
        .filter_map(|(name, r)| {
            token_span(&offsets, &(r.start + base..r.end + base)).map(|s| kvreplay_traces::Span {
                name: name.clone(),
                start: s.start,
                end: s.end,
            })
        })
        .collect();
    Ok((ids, spans, t.source))
}

/// The default suite: pass key retrieval at four lengths from 512 to 4,096
/// tokens, each with its needle at a different depth (0.1, 0.4, 0.6, 0.9).
pub fn default_suite() -> Vec<(String, String)> {
    [(512, 0.1), (1024, 0.4), (2048, 0.6), (4096, 0.9)]
        .iter()
        .map(|&(length, depth)| {
            (
                format!(
                    "passkey-{length:04}-d{:02}.kvtrace",
                    (depth * 100.0f64).round() as usize
                ),
                format!("passkey:length={length},depth={depth}"),
            )
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn task_specs_parse_without_a_model() {
        assert_eq!(
            TaskSpec::parse("passkey:length=512,depth=0.1").unwrap(),
            TaskSpec::Passkey {
                length: 512,
                depth: 0.1
            }
        );
        assert_eq!(
            TaskSpec::parse("multifact").unwrap(),
            TaskSpec::Multifact {
                length: 1024,
                facts: 4
            }
        );
        assert_eq!(
            TaskSpec::parse("file:notes:v2.txt").unwrap(),
            TaskSpec::File("notes:v2.txt".into())
        );
        let e = TaskSpec::parse("essay:length=5").unwrap_err().to_string();
        assert!(e.contains("unknown task `essay`"), "{e}");
    }

    #[test]
    fn absurd_task_lengths_and_fact_counts_are_refused_when_parsed() {
        // both once built filler (or encoded facts) until memory ran out
        for (spec, why) in [
            ("passkey:length=1000000000000000", "up to 16777216"),
            ("multifact:length=100,facts=1000000000000", "cannot fit"),
        ] {
            let e = TaskSpec::parse(spec).unwrap_err().to_string();
            assert!(e.contains(spec) && e.contains(why), "{e}");
        }
    }
}
