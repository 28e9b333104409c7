//! The model's tokenizer, built in memory from GGUF metadata.
//!
//! Byte-level BPE ("gpt2" tokenizer model) through the HF `tokenizers` crate,
//! with the pre-tokenizer the file names in `tokenizer.ggml.pre`, matching
//! llama.cpp's tokenisation (control tokens are matched whole, no BOS is added).

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

pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    pub bos: Option<u32>,
    pub eos: Option<u32>,
    tokens: Vec<String>,
    chat_template: Option<String>,
    /// The model file, named in chat template errors.
    source: std::path::PathBuf,
}

/// Instructions a chat template may run for one message (minijinja fuel).
/// SmolLM2-135M-Instruct's template takes 39; nested loops of 100,000
/// steps each would run for hours.
pub const CHAT_TEMPLATE_FUEL: u64 = 1_000_000;

impl Tokenizer {
    pub fn from_gguf(g: &GgufFile) -> Result<Tokenizer, CaptureError> {
        let model = g.get_str("tokenizer.ggml.model")?;
        if model != "gpt2" {
            return Err(CaptureError::Unsupported {
                path: g.path.clone(),
                msg: format!(
                    "tokenizer model `{model}` (tokenizer.ggml.model); only byte-level BPE (`gpt2`) is supported"
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
        let id = |k: &str| g.get(k).and_then(|v| v.as_u64()).map(|v| v as u32);
        Ok(Tokenizer {
            inner,
            bos: id("tokenizer.ggml.bos_token_id"),
            eos: id("tokenizer.ggml.eos_token_id"),
            tokens,
            source: g.path.clone(),
            chat_template: g
                .get("tokenizer.chat_template")
                .and_then(|v| v.as_str())
                .map(String::from),
        })
    }

    pub fn vocab_size(&self) -> usize {
        self.tokens.len()
    }

    /// Token ids of `text`, adding no special tokens (control tokens written
    /// in the text are matched whole, as llama.cpp does with `special=true`).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, CaptureError> {
        let enc = self
            .inner
            .encode(text, false)
            .map_err(|e| CaptureError::Tokenizer(e.to_string()))?;
        Ok(enc.get_ids().to_vec())
    }

    /// Token ids of `text` and each token's byte range in it.
    pub fn encode_with_offsets(&self, text: &str) -> Result<Encoded, CaptureError> {
        let enc = self
            .inner
            .encode(text, false)
            .map_err(|e| CaptureError::Tokenizer(e.to_string()))?;
        Ok((enc.get_ids().to_vec(), enc.get_offsets().to_vec()))
    }

    /// The decoded text of one token (control tokens as written).
    pub fn decode_token(&self, id: u32) -> String {
        self.inner
            .decode(&[id], false)
            .unwrap_or_else(|_| self.tokens.get(id as usize).cloned().unwrap_or_default())
    }

    /// Decode a sequence of ids to text.
    pub fn decode(&self, ids: &[u32]) -> String {
        self.inner.decode(ids, false).unwrap_or_default()
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
