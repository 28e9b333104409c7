//! The model's tokenizer, built in memory from GGUF metadata.
//!
//! Byte-level BPE ("gpt2" tokenizer model) through the HF `tokenizers` crate,
//! with the pre-tokenizer the file names in `tokenizer.ggml.pre`, matching
//! llama.cpp's tokenisation (control tokens are matched whole, no BOS is added).
//!
//! SentencePiece vocabularies (`tokenizer.ggml.model = llama`, Gemma 3) with
//! [`Spm`], llama.cpp's `llm_tokenizer_spm`: spaces become `▁`, the text
//! starts as one symbol per UTF-8 character, the adjacent pair whose
//! concatenation is a piece with the highest score is merged (ties: the
//! leftmost) until none is, and a symbol that is no piece falls back to its
//! bytes as `<0xNN>` pieces. Control and user-defined pieces written in the
//! text are matched whole; BOS is prepended when
//! `tokenizer.ggml.add_bos_token` says so.
//!
//! Matching those pieces in the raw text is llama.cpp's behaviour (and HF's
//! added tokens'), not the `sentencepiece` library's: Gemma 3's user-defined
//! whitespace runs (`"  "`, `"   "`, ...) and control strings typed in the
//! text (`<start_of_turn>`) become one piece here, while a SentencePiece
//! model built from the same pieces escapes the spaces first and spells
//! control strings out. Text without runs of spaces or control strings
//! tokenizes identically in both (scripts/reference_gemma3.py checks that).

use tokenizers::models::bpe::{Vocab, BPE};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::{AddedToken, PreTokenizerWrapper, SplitDelimiterBehavior};

use crate::gguf::GgufFile;
use crate::CaptureError;

/// llama.cpp's LLAMA3 pre-tokenizer regex (`llama-bpe`).
const LLAMA3_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// llama.cpp's QWEN2 pre-tokenizer regex (single digits).
const QWEN2_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// Pre-tokenizer names (`tokenizer.ggml.pre`) this build supports.
pub const SUPPORTED_PRE: &[&str] = &["smollm", "gpt2", "default", "llama-bpe", "llama3", "qwen2"];

/// Token ids and each token's byte range in the encoded text.
pub type Encoded = (Vec<u32>, Vec<(usize, usize)>);

enum Inner {
    Bpe(Box<tokenizers::Tokenizer>),
    Spm(Box<Spm>),
}

pub struct Tokenizer {
    inner: Inner,
    pub bos: Option<u32>,
    pub eos: Option<u32>,
    tokens: Vec<String>,
    chat_template: Option<String>,
    /// The model file, named in chat template errors.
    source: std::path::PathBuf,
    /// Add the special tokens of the tokenizer's post-processor (BOS...)
    /// when encoding plain text (HF `tokenizer.json`; GGUF BPE: no).
    add_special: bool,
    /// HF Llama/Gemma tokenizer classes rebuild their post-processor from
    /// `add_bos_token`/`add_eos_token` (transformers' `update_post_processor`):
    /// when set, plain text gets these (BOS first, EOS last) instead of the
    /// tokenizer.json post-processor's special tokens.
    bos_eos_override: Option<(Option<u32>, Option<u32>)>,
}

/// Instructions a chat template may run for one message (minijinja fuel).
/// SmolLM2-135M-Instruct's template takes 39; nested loops of 100,000
/// steps each would run for hours.
pub const CHAT_TEMPLATE_FUEL: u64 = 1_000_000;

impl Tokenizer {
    pub fn from_gguf(g: &GgufFile) -> Result<Tokenizer, CaptureError> {
        let model = g.get_str("tokenizer.ggml.model")?;
        let id = |k: &str| g.get(k).and_then(|v| v.as_u64()).map(|v| v as u32);
        if model == "llama" {
            let spm = Spm::from_gguf(g)?;
            return Ok(Tokenizer {
                bos: id("tokenizer.ggml.bos_token_id"),
                eos: id("tokenizer.ggml.eos_token_id"),
                tokens: spm.pieces.clone(),
                inner: Inner::Spm(Box::new(spm)),
                source: g.path.clone(),
                add_special: false,
                bos_eos_override: None,
                chat_template: g
                    .get("tokenizer.chat_template")
                    .and_then(|v| v.as_str())
                    .map(String::from),
            });
        }
        if model != "gpt2" {
            return Err(CaptureError::Unsupported {
                path: g.path.clone(),
                msg: format!(
                    "tokenizer model `{model}` (tokenizer.ggml.model); only byte-level BPE (`gpt2`) and SentencePiece (`llama`) are supported"
                ),
            });
        }
        let pre = g
            .get("tokenizer.ggml.pre")
            .and_then(|v| v.as_str())
            .unwrap_or("default");
        let tokens: Vec<String> = g
            .get_strings("tokenizer.ggml.tokens")?
            .iter()
            .map(String::from)
            .collect();
        let merges: Vec<(String, String)> = g
            .get_strings("tokenizer.ggml.merges")?
            .iter()
            .map(|m| {
                m.split_once(' ')
                    .map(|(a, b)| (a.to_string(), b.to_string()))
                    .ok_or_else(|| CaptureError::Metadata {
                        path: g.path.clone(),
                        key: "tokenizer.ggml.merges".into(),
                        problem: format!(
                            "holding `{m}`, which is not two tokens separated by a space"
                        ),
                    })
            })
            .collect::<Result<_, _>>()?;
        let types: Vec<u64> = match g
            .get("tokenizer.ggml.token_type")
            .and_then(|v| v.as_array())
        {
            Some(a) => (0..a.len()).map(|i| a.u64_at(i).unwrap_or(1)).collect(),
            None => vec![1; tokens.len()],
        };
        let vocab: Vocab = tokens
            .iter()
            .enumerate()
            .map(|(i, t)| (t.clone(), i as u32))
            .collect();
        let tok_err =
            |e: Box<dyn std::error::Error + Send + Sync>| CaptureError::Tokenizer(e.to_string());
        let bpe = BPE::builder()
            .vocab_and_merges(vocab, merges)
            .ignore_merges(matches!(pre, "llama-bpe" | "llama3"))
            .build()
            .map_err(tok_err)?;
        let mut inner = tokenizers::Tokenizer::new(bpe);
        let split = |re: &str| -> Result<PreTokenizerWrapper, CaptureError> {
            Ok(Split::new(
                SplitPattern::Regex(re.into()),
                SplitDelimiterBehavior::Isolated,
                false,
            )
            .map_err(tok_err)?
            .into())
        };
        let pre_tok: PreTokenizerWrapper = match pre {
            "smollm" => Sequence::new(vec![
                Digits::new(true).into(),
                ByteLevel::new(false, true, true).into(),
            ])
            .into(),
            "gpt2" | "default" => ByteLevel::new(false, true, true).into(),
            "llama-bpe" | "llama3" => Sequence::new(vec![
                split(LLAMA3_SPLIT)?,
                ByteLevel::new(false, true, false).into(),
            ])
            .into(),
            "qwen2" => Sequence::new(vec![
                split(QWEN2_SPLIT)?,
                ByteLevel::new(false, true, false).into(),
            ])
            .into(),
            other => {
                return Err(CaptureError::Unsupported {
                    path: g.path.clone(),
                    msg: format!(
                        "pre-tokenizer `{other}` (tokenizer.ggml.pre); supported: {}",
                        SUPPORTED_PRE.join(", ")
                    ),
                })
            }
        };
        inner.with_pre_tokenizer(Some(pre_tok));
        inner.with_decoder(Some(tokenizers::decoders::byte_level::ByteLevel::default()));
        // Control tokens (type 3) are special and matched whole; user-defined (4) are plain added tokens.
        let special: Vec<AddedToken> = tokens
            .iter()
            .zip(&types)
            .filter(|(_, t)| **t == 3)
            .map(|(s, _)| AddedToken::from(s.clone(), true))
            .collect();
        inner.add_special_tokens(&special);
        let user: Vec<AddedToken> = tokens
            .iter()
            .zip(&types)
            .filter(|(_, t)| **t == 4)
            .map(|(s, _)| AddedToken::from(s.clone(), false))
            .collect();
        inner.add_tokens(&user);
        Ok(Tokenizer {
            inner: Inner::Bpe(Box::new(inner)),
            bos: id("tokenizer.ggml.bos_token_id"),
            eos: id("tokenizer.ggml.eos_token_id"),
            tokens,
            source: g.path.clone(),
            add_special: false,
            bos_eos_override: None,
            chat_template: g
                .get("tokenizer.chat_template")
                .and_then(|v| v.as_str())
                .map(String::from),
        })
    }

    /// An HF checkpoint's tokenizer: `tokenizer.json` through the
    /// `tokenizers` crate, with BOS/EOS and the chat template from
    /// `tokenizer_config.json` (or `chat_template.jinja`) when present.
    /// Plain text is encoded with the tokenizer's special tokens (its
    /// post-processor, as transformers' `add_special_tokens=True`); a rendered
    /// chat template without (it writes its own BOS), as
    /// `apply_chat_template` does.
    pub fn from_hf(dir: &std::path::Path) -> Result<Tokenizer, CaptureError> {
        let tj = dir.join("tokenizer.json");
        if !tj.exists() {
            return Err(CaptureError::Io {
                path: tj,
                err: std::io::Error::new(
                    std::io::ErrorKind::NotFound,
                    "missing; the checkpoint needs its tokenizer.json",
                ),
            });
        }
        let inner = tokenizers::Tokenizer::from_file(&tj).map_err(|e| CaptureError::Config {
            path: tj.clone(),
            field: "(file)".into(),
            problem: format!("not a tokenizer the tokenizers crate reads: {e}"),
        })?;
        let n = inner.get_vocab_size(true);
        let tokens: Vec<String> = (0..n as u32)
            .map(|i| inner.id_to_token(i).unwrap_or_default())
            .collect();
        let tc_path = dir.join("tokenizer_config.json");
        let tc = if tc_path.exists() {
            Some(crate::hf::read_json_file(&tc_path)?)
        } else {
            None
        };
        let special = |key: &str| -> Option<u32> {
            let v = tc.as_ref()?.get(key)?;
            let s = v
                .as_str()
                .or_else(|| v.get("content").and_then(|c| c.as_str()))?;
            inner.token_to_id(s)
        };
        let mut chat_template = match tc.as_ref().and_then(|t| t.get("chat_template")) {
            Some(serde_json::Value::String(s)) => Some(s.clone()),
            Some(serde_json::Value::Array(a)) => a
                .iter()
                .find(|t| t.get("name").and_then(|n| n.as_str()) == Some("default"))
                .and_then(|t| t.get("template"))
                .and_then(|t| t.as_str())
                .map(String::from),
            _ => None,
        };
        let jinja = dir.join("chat_template.jinja");
        if chat_template.is_none() && jinja.is_file() {
            chat_template =
                Some(std::fs::read_to_string(&jinja).map_err(|e| CaptureError::io(&jinja, e))?);
        }
        let (bos, eos) = (special("bos_token"), special("eos_token"));
        let class = tc
            .as_ref()
            .and_then(|t| t.get("tokenizer_class"))
            .and_then(|c| c.as_str())
            .unwrap_or("");
        let flag = |k: &str| tc.as_ref().and_then(|t| t.get(k)).and_then(|v| v.as_bool());
        let rebuilds = matches!(
            class.trim_end_matches("Fast"),
            "LlamaTokenizer" | "GemmaTokenizer" | "CodeLlamaTokenizer"
        );
        let bos_eos_override = match (flag("add_bos_token"), flag("add_eos_token")) {
            (None, None) => None,
            _ if !rebuilds => None,
            // transformers' defaults: add_bos_token true, add_eos_token false
            (b, e) => Some((
                bos.filter(|_| b.unwrap_or(true)),
                eos.filter(|_| e.unwrap_or(false)),
            )),
        };
        Ok(Tokenizer {
            bos,
            eos,
            tokens,
            chat_template,
            source: tc_path,
            add_special: true,
            bos_eos_override,
            inner: Inner::Bpe(Box::new(inner)),
        })
    }

    pub fn vocab_size(&self) -> usize {
        self.tokens.len()
    }

    /// Token ids of `text`, adding no special tokens (control tokens written
    /// in the text are matched whole, as llama.cpp does with `special=true`).
    /// (SentencePiece vocabularies add BOS when the file says so.)
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, CaptureError> {
        Ok(self.encode_with_offsets(text)?.0)
    }

    /// Token ids of text rendered by [`Tokenizer::apply_chat_template`]
    /// (which writes its own special tokens: an HF tokenizer adds none).
    pub fn encode_chat(&self, rendered: &str) -> Result<Encoded, CaptureError> {
        self.encode_impl(rendered, false)
    }

    /// Token ids of `text` without the special tokens an HF tokenizer adds
    /// to plain text (for counting the tokens of a piece of a longer prompt;
    /// the other tokenizers encode as [`Tokenizer::encode`]).
    pub fn encode_piece(&self, text: &str) -> Result<Vec<u32>, CaptureError> {
        Ok(self.encode_impl(text, false)?.0)
    }

    /// Token ids of `text` and each token's byte range in it.
    pub fn encode_with_offsets(&self, text: &str) -> Result<Encoded, CaptureError> {
        self.encode_impl(text, self.add_special)
    }

    fn encode_impl(&self, text: &str, add_special: bool) -> Result<Encoded, CaptureError> {
        if let (true, Some((bos, eos))) = (add_special, self.bos_eos_override) {
            let (mut ids, mut offs) = self.encode_impl(text, false)?;
            if let Some(b) = bos {
                ids.insert(0, b);
                offs.insert(0, (0, 0));
            }
            if let Some(e) = eos {
                ids.push(e);
                offs.push((text.len(), text.len()));
            }
            return Ok((ids, offs));
        }
        match &self.inner {
            Inner::Bpe(t) => {
                let enc = t
                    .encode(text, add_special)
                    .map_err(|e| CaptureError::Tokenizer(e.to_string()))?;
                Ok((enc.get_ids().to_vec(), enc.get_offsets().to_vec()))
            }
            Inner::Spm(s) => Ok(s.encode(text)),
        }
    }

    /// The decoded text of one token (control tokens as written).
    pub fn decode_token(&self, id: u32) -> String {
        match &self.inner {
            Inner::Bpe(t) => t
                .decode(&[id], false)
                .unwrap_or_else(|_| self.tokens.get(id as usize).cloned().unwrap_or_default()),
            Inner::Spm(s) => s.decode(&[id]),
        }
    }

    /// Decode a sequence of ids to text.
    pub fn decode(&self, ids: &[u32]) -> String {
        match &self.inner {
            Inner::Bpe(t) => t.decode(ids, false).unwrap_or_default(),
            Inner::Spm(s) => s.decode(ids),
        }
    }

    /// Whether the model ships a chat template (instruction-tuned models do;
    /// base models such as Gemma 3 270M do not).
    pub fn has_chat_template(&self) -> bool {
        self.chat_template.is_some()
    }

    /// Render the model's chat template for one user message, ready for the
    /// assistant's reply.
    pub fn apply_chat_template(&self, user: &str) -> Result<String, CaptureError> {
        let tmpl = self.chat_template.as_deref().ok_or_else(|| {
            CaptureError::InvalidOption(
                "--chat: the model file has no tokenizer.chat_template; pass the prompt without --chat".into(),
            )
        })?;
        let mut env = minijinja::Environment::new();
        minijinja_contrib::add_to_environment(&mut env);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function(
            "raise_exception",
            |msg: String| -> Result<String, minijinja::Error> {
                Err(minijinja::Error::new(
                    minijinja::ErrorKind::InvalidOperation,
                    msg,
                ))
            },
        );
        env.set_fuel(Some(CHAT_TEMPLATE_FUEL));
        let err = |e: minijinja::Error| {
            match e.kind() {
            minijinja::ErrorKind::OutOfFuel => CaptureError::Metadata {
                path: self.source.clone(),
                key: "tokenizer.chat_template".into(),
                problem: format!(
                    "a template that did not finish within {CHAT_TEMPLATE_FUEL} steps (loops without a sane bound); capture without --chat, or fix the template in the model file"
                ),
            },
            _ => CaptureError::Tokenizer(format!("chat template: {e}")),
        }
        };
        env.add_template("chat", tmpl).map_err(err)?;
        let token_text = |id: Option<u32>| {
            id.and_then(|i| self.tokens.get(i as usize))
                .cloned()
                .unwrap_or_default()
        };
        let ctx = minijinja::context! {
            messages => vec![minijinja::context!{ role => "user", content => user }],
            add_generation_prompt => true,
            bos_token => token_text(self.bos),
            eos_token => token_text(self.eos),
        };
        env.get_template("chat")
            .and_then(|t| t.render(ctx))
            .map_err(err)
    }
}

/// A SentencePiece vocabulary tokenised as llama.cpp's `llm_tokenizer_spm`
/// does (see the module docs).
pub struct Spm {
    pieces: Vec<String>,
    scores: Vec<f32>,
    types: Vec<u64>,
    ids: std::collections::HashMap<String, u32>,
    /// `<0xNN>` piece of each byte.
    bytes: Vec<Option<u32>>,
    /// Control (3) and user-defined (4) pieces, matched whole in the text,
    /// longest first.
    specials: Vec<(String, u32)>,
    /// Bytes a special piece starts with (the text is scanned only there).
    special_first: [bool; 256],
    bos: Option<u32>,
    add_bos: bool,
    add_space_prefix: bool,
}

impl Spm {
    pub fn from_gguf(g: &GgufFile) -> Result<Spm, CaptureError> {
        let pieces: Vec<String> = g
            .get_strings("tokenizer.ggml.tokens")?
            .iter()
            .map(String::from)
            .collect();
        let n = pieces.len();
        let meta_err = |key: &str, problem: String| CaptureError::Metadata {
            path: g.path.clone(),
            key: key.into(),
            problem,
        };
        let scores: Vec<f32> = match g.get("tokenizer.ggml.scores").and_then(|v| v.as_array()) {
            Some(crate::gguf::MetaArray::F32(v)) if v.len() == n => v.clone(),
            Some(a) => {
                return Err(meta_err(
                    "tokenizer.ggml.scores",
                    format!("{} entries (need {n} f32 scores)", a.len()),
                ))
            }
            None => {
                return Err(meta_err(
                    "tokenizer.ggml.scores",
                    "missing; a SentencePiece vocabulary needs piece scores".into(),
                ))
            }
        };
        let types: Vec<u64> = match g
            .get("tokenizer.ggml.token_type")
            .and_then(|v| v.as_array())
        {
            Some(a) => (0..n).map(|i| a.u64_at(i).unwrap_or(1)).collect(),
            None => vec![1; n],
        };
        let mut ids = std::collections::HashMap::with_capacity(n);
        for (i, p) in pieces.iter().enumerate() {
            ids.entry(p.clone()).or_insert(i as u32);
        }
        let bytes = (0..256)
            .map(|b| ids.get(&format!("<0x{b:02X}>")).copied())
            .collect();
        let mut specials: Vec<(String, u32)> = pieces
            .iter()
            .zip(&types)
            .enumerate()
            .filter(|(_, (p, t))| (**t == 3 || **t == 4) && !p.is_empty())
            .map(|(i, (p, _))| (p.clone(), i as u32))
            .collect();
        specials.sort_by(|a, b| b.0.len().cmp(&a.0.len()).then(a.1.cmp(&b.1)));
        let mut special_first = [false; 256];
        for (p, _) in &specials {
            special_first[p.as_bytes()[0] as usize] = true;
        }
        let flag = |k: &str, default: bool| match g.get(k) {
            Some(crate::gguf::MetaValue::Bool(b)) => *b,
            _ => default,
        };
        Ok(Spm {
            bos: g
                .get("tokenizer.ggml.bos_token_id")
                .and_then(|v| v.as_u64())
                .map(|v| v as u32),
            add_bos: flag("tokenizer.ggml.add_bos_token", true),
            add_space_prefix: flag("tokenizer.ggml.add_space_prefix", true),
            pieces,
            scores,
            types,
            ids,
            bytes,
            specials,
            special_first,
        })
    }

    /// Ids of `text` (BOS first when the vocabulary adds it) and each id's
    /// byte range in `text` (BOS: an empty range at 0; a space prefix added
    /// by the tokenizer is counted in the first token's range).
    pub fn encode(&self, text: &str) -> Encoded {
        let mut ids = Vec::new();
        let mut offs = Vec::new();
        if self.add_bos {
            if let Some(b) = self.bos {
                ids.push(b);
                offs.push((0, 0));
            }
        }
        // Split on control / user-defined pieces, matched whole.
        let mut at = 0;
        let mut plain_start = 0;
        let mut first = true;
        while at < text.len() {
            let hit = if self.special_first[text.as_bytes()[at] as usize] {
                self.specials
                    .iter()
                    .find(|(p, _)| text[at..].starts_with(p.as_str()))
            } else {
                None
            };
            match hit {
                Some((p, id)) => {
                    if plain_start < at {
                        self.encode_plain(text, plain_start, at, first, &mut ids, &mut offs);
                    }
                    first = false;
                    ids.push(*id);
                    offs.push((at, at + p.len()));
                    at += p.len();
                    plain_start = at;
                }
                None => at += text[at..].chars().next().map_or(1, char::len_utf8),
            }
        }
        if plain_start < text.len() {
            self.encode_plain(text, plain_start, text.len(), first, &mut ids, &mut offs);
        }
        (ids, offs)
    }

    /// llama.cpp's SPM merge loop over text[start..end].
    fn encode_plain(
        &self,
        text: &str,
        start: usize,
        end: usize,
        first: bool,
        ids: &mut Vec<u32>,
        offs: &mut Vec<(usize, usize)>,
    ) {
        use std::cmp::Reverse;
        use std::collections::BinaryHeap;
        // The escaped text and, per escaped byte, its byte in `text`.
        let mut esc = String::new();
        let mut src: Vec<usize> = Vec::new();
        if self.add_space_prefix && first {
            esc.push('▁');
            src.extend([start; 3]);
        }
        for (i, ch) in text[start..end].char_indices() {
            if ch == ' ' {
                esc.push('▁');
                src.extend([start + i; 3]);
            } else {
                esc.push(ch);
                src.extend((0..ch.len_utf8()).map(|_| start + i));
            }
        }
        src.push(end);
        // Symbols: (start, len) in `esc`, linked by prev / next.
        struct Sym {
            at: usize,
            n: usize,
            prev: Option<usize>,
            next: Option<usize>,
        }
        let mut syms: Vec<Sym> = Vec::new();
        for (i, ch) in esc.char_indices() {
            let k = syms.len();
            syms.push(Sym {
                at: i,
                n: ch.len_utf8(),
                prev: k.checked_sub(1),
                next: None,
            });
            if k > 0 {
                syms[k - 1].next = Some(k);
            }
        }
        // (score, leftmost first, left, right, merged length)
        type Bigram = (OrdF32, Reverse<usize>, usize, usize);
        let mut heap: BinaryHeap<Bigram> = BinaryHeap::new();
        let mut merged_from: std::collections::HashMap<(usize, usize), (usize, usize)> =
            std::collections::HashMap::new();
        let push = |heap: &mut BinaryHeap<Bigram>, syms: &[Sym], l: usize, r: usize| {
            let piece = &esc[syms[l].at..syms[r].at + syms[r].n];
            if let Some(&id) = self.ids.get(piece) {
                heap.push((
                    OrdF32(self.scores[id as usize]),
                    Reverse(l),
                    l,
                    syms[l].n + syms[r].n,
                ));
            }
        };
        for l in 1..syms.len() {
            push(&mut heap, &syms, l - 1, l);
        }
        // Each bigram's right symbol, looked up when popped (it is the left's
        // `next` when the bigram is still valid).
        while let Some((_, _, l, len)) = heap.pop() {
            let Some(r) = syms[l].next else { continue };
            if syms[l].n == 0 || syms[r].n == 0 || syms[l].n + syms[r].n != len {
                continue;
            }
            merged_from.insert((syms[l].at, len), (syms[l].n, syms[r].n));
            syms[l].n += syms[r].n;
            syms[r].n = 0;
            syms[l].next = syms[r].next;
            if let Some(nn) = syms[r].next {
                syms[nn].prev = Some(l);
            }
            if let Some(p) = syms[l].prev {
                push(&mut heap, &syms, p, l);
            }
            if let Some(nn) = syms[l].next {
                push(&mut heap, &syms, l, nn);
            }
        }
        let mut i = if syms.is_empty() { None } else { Some(0) };
        while let Some(k) = i {
            self.resegment(&esc, &src, syms[k].at, syms[k].n, &merged_from, ids, offs);
            i = syms[k].next;
        }
    }

    /// Emit the piece esc[at..at+n], or its two merged halves, or its bytes.
    #[allow(clippy::too_many_arguments)]
    fn resegment(
        &self,
        esc: &str,
        src: &[usize],
        at: usize,
        n: usize,
        merged_from: &std::collections::HashMap<(usize, usize), (usize, usize)>,
        ids: &mut Vec<u32>,
        offs: &mut Vec<(usize, usize)>,
    ) {
        if let Some(&id) = self.ids.get(&esc[at..at + n]) {
            ids.push(id);
            offs.push((src[at], src[at + n]));
            return;
        }
        if let Some(&(a, b)) = merged_from.get(&(at, n)) {
            self.resegment(esc, src, at, a, merged_from, ids, offs);
            self.resegment(esc, src, at + a, b, merged_from, ids, offs);
            return;
        }
        for (j, b) in esc.as_bytes()[at..at + n].iter().enumerate() {
            // A byte without a `<0xNN>` piece becomes the unknown piece (0 if none).
            let id = self.bytes[*b as usize]
                .or_else(|| self.ids.get("<unk>").copied())
                .unwrap_or(0);
            ids.push(id);
            offs.push((src[at + j], src[at + j + 1].max(src[at + j])));
        }
    }

    /// Text of `ids`: `▁` as a space, `<0xNN>` pieces as their bytes (UTF-8
    /// decoded lossily), control pieces as written.
    pub fn decode(&self, ids: &[u32]) -> String {
        let mut out: Vec<u8> = Vec::new();
        for &id in ids {
            let Some(p) = self.pieces.get(id as usize) else {
                continue;
            };
            let ty = self.types.get(id as usize).copied().unwrap_or(1);
            if ty == 6 {
                if let Some(b) = p
                    .strip_prefix("<0x")
                    .and_then(|h| h.strip_suffix('>'))
                    .and_then(|h| u8::from_str_radix(h, 16).ok())
                {
                    out.push(b);
                    continue;
                }
            }
            out.extend_from_slice(p.replace('▁', " ").as_bytes());
        }
        String::from_utf8_lossy(&out).into_owned()
    }
}

/// An f32 ordered totally (for the merge queue).
#[derive(Clone, Copy, PartialEq)]
struct OrdF32(f32);
impl Eq for OrdF32 {}
impl PartialOrd for OrdF32 {
    fn partial_cmp(&self, o: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(o))
    }
}
impl Ord for OrdF32 {
    fn cmp(&self, o: &Self) -> std::cmp::Ordering {
        self.0.total_cmp(&o.0)
    }
}
