#include "text/tokenizer.h"

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <cmath>
#include <functional>
#include <limits>

#include "text/tokenizer_utf8.h"

namespace gemma4::text {
namespace {

constexpr uint64_t kEmptyPair = std::numeric_limits<uint64_t>::max();
constexpr uint32_t kUnderline = 0x2581;  // '▁', SentencePiece's visible space
constexpr std::string_view kUnderlineUtf8 = "\xE2\x96\x81";

uint64_t pair_key(int32_t left, int32_t right) {
  return (uint64_t{static_cast<uint32_t>(left)} << 32) | static_cast<uint32_t>(right);
}

// splitmix64's finalizer: spreads consecutive ids over the whole table.
uint64_t mix_bits(uint64_t x) {
  x ^= x >> 30;
  x *= 0xBF58476D1CE4E5B9ULL;
  x ^= x >> 27;
  x *= 0x94D049BB133111EBULL;
  return x ^ (x >> 31);
}

size_t table_capacity(size_t entries) {
  return std::bit_ceil(std::max<size_t>(16, entries * 2));
}

// HF's ByteFallback decoder accepts a token as a byte when it is exactly "<0x" + two characters
// + ">" and Rust's u8::from_str_radix(.., 16) parses the two characters (which allows "+F").
int16_t fallback_byte_value(std::string_view piece) {
  if (piece.size() != 6 || !piece.starts_with("<0x") || piece.back() != '>') return -1;
  const auto hex_digit = [](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
  };
  if (piece[3] == '+') return static_cast<int16_t>(hex_digit(piece[4]));
  const int high = hex_digit(piece[3]), low = hex_digit(piece[4]);
  return high < 0 || low < 0 ? int16_t{-1} : static_cast<int16_t>(high * 16 + low);
}

std::string replace_underlines(std::string_view piece) {
  std::string out;
  out.reserve(piece.size());
  for (size_t i = 0; i < piece.size();) {
    if (piece.substr(i, kUnderlineUtf8.size()) == kUnderlineUtf8) {
      out += ' ';
      i += kUnderlineUtf8.size();
    } else {
      out += piece[i++];
    }
  }
  return out;
}

// Collects the characters that a merge result (`piece`) holds right before a '▁' (other than
// '▁'), or next to a '\n' (other than '\n'): BPE symbols can span such a pair, so the place
// between them is no chunk boundary.
void note_chunk_joiners(std::string_view piece, std::vector<uint32_t>& underline_joiners,
                        std::vector<uint32_t>& newline_joiners) {
  if (piece.find('\n') == std::string_view::npos &&
      piece.find(kUnderlineUtf8) == std::string_view::npos) {
    return;
  }
  uint32_t previous = 0;
  for (size_t i = 0; i < piece.size();) {
    uint32_t code_point;
    const size_t length = utf8::decode_one(piece.substr(i), code_point);
    if (length == 0) return;  // not text; a byte piece never sits next to anything
    if (i > 0) {
      if (code_point == kUnderline && previous != kUnderline) underline_joiners.push_back(previous);
      if ((previous == '\n') != (code_point == '\n')) {
        newline_joiners.push_back(previous == '\n' ? code_point : previous);
      }
    }
    previous = code_point;
    i += length;
  }
}

void sort_unique(std::vector<uint32_t>& values) {
  std::sort(values.begin(), values.end());
  values.erase(std::unique(values.begin(), values.end()), values.end());
}

bool contains(const std::vector<uint32_t>& sorted, uint32_t value) {
  return std::binary_search(sorted.begin(), sorted.end(), value);
}

// Per-thread scratch space for BPE, reused across calls so that encoding allocates nothing
// beyond the output once warmed up.
struct Symbol {
  int32_t id;  // -1 once merged into its left neighbour
  int32_t prev;
  int32_t next;
};
struct PendingMerge {
  uint32_t rank;
  int32_t position;  // index of the left symbol
  int32_t left_id;   // the pair when queued: the entry is stale once either side has changed
  int32_t right_id;
  int32_t merged_id;
};
// Max-heap order for std::push_heap: the lowest rank, then the leftmost position, comes first
// (HF's Word::merge_all).
bool lower_priority(const PendingMerge& a, const PendingMerge& b) {
  return a.rank != b.rank ? a.rank > b.rank : a.position > b.position;
}
struct BpeWorkspace {
  std::vector<Symbol> symbols;
  std::vector<PendingMerge> queue;
};
thread_local BpeWorkspace bpe_workspace;

// Per-thread cache of chunk -> ids (HF keeps a similar word cache). Entries belong to one
// tokenizer (owner = its cache id); the cache is emptied when another tokenizer uses it or when
// it is full, which bounds its memory.
struct StringHash {
  using is_transparent = void;
  size_t operator()(std::string_view text) const { return std::hash<std::string_view>{}(text); }
};
struct ChunkCache {
  static constexpr size_t kMaxChunkBytes = 64;
  static constexpr size_t kMaxEntries = 1 << 15;
  uint64_t owner = 0;
  std::unordered_map<std::string, std::pair<uint32_t, uint32_t>, StringHash, std::equal_to<>>
      entries;  // chunk -> (offset, count) in ids
  std::vector<int32_t> ids;

  void clear() {
    entries.clear();
    ids.clear();
  }
  void insert(std::string_view chunk, std::span<const int32_t> chunk_ids) {
    if (entries.size() >= kMaxEntries) clear();
    entries.emplace(chunk, std::pair{static_cast<uint32_t>(ids.size()),
                                     static_cast<uint32_t>(chunk_ids.size())});
    ids.insert(ids.end(), chunk_ids.begin(), chunk_ids.end());
  }
};
thread_local ChunkCache chunk_cache;
std::atomic<uint64_t> next_cache_id{1};

}  // namespace

Expected<Tokenizer> Tokenizer::build(LoadedVocab vocab) {
  const size_t count = vocab.pieces.size();
  if (count == 0) return make_error(ErrorCode::kInvalidArgument, "tokenizer has no tokens");
  if (count >= static_cast<size_t>(std::numeric_limits<int32_t>::max())) {
    return make_error(ErrorCode::kInvalidArgument, "tokenizer has too many tokens ({})", count);
  }
  Tokenizer tok;
  tok.cache_id_ = next_cache_id.fetch_add(1);
  tok.byte_fallback_ = vocab.byte_fallback;
  tok.fuse_unk_ = vocab.fuse_unk;
  tok.space_to_underline_ = vocab.space_to_underline;
  tok.exists_ = std::move(vocab.exists);

  size_t total_bytes = 0;
  for (const auto& piece : vocab.pieces) total_bytes += piece.size();
  if (total_bytes >= std::numeric_limits<uint32_t>::max()) {
    return make_error(ErrorCode::kInvalidArgument, "tokenizer pieces are too large");
  }
  tok.token_text_.reserve(total_bytes);
  tok.token_offsets_.reserve(count + 1);
  tok.decoded_offsets_.reserve(count + 1);
  tok.byte_values_.reserve(count);
  for (const auto& piece : vocab.pieces) {
    tok.token_offsets_.push_back(static_cast<uint32_t>(tok.token_text_.size()));
    tok.token_text_ += piece;
    const std::string decoded = replace_underlines(piece);
    tok.decoded_offsets_.push_back(static_cast<uint32_t>(tok.decoded_text_.size()));
    tok.decoded_text_ += decoded;
    tok.byte_values_.push_back(fallback_byte_value(decoded));
  }
  tok.token_offsets_.push_back(static_cast<uint32_t>(tok.token_text_.size()));
  tok.decoded_offsets_.push_back(static_cast<uint32_t>(tok.decoded_text_.size()));

  // Piece -> id (the first id wins for a duplicated piece).
  tok.token_index_.assign(table_capacity(count), -1);
  const size_t index_mask = tok.token_index_.size() - 1;
  const std::hash<std::string_view> hash_piece;
  for (size_t id = 0; id < count; ++id) {
    if (!tok.exists_[id]) continue;
    const std::string_view piece = tok.id_to_token(static_cast<int32_t>(id));
    for (size_t slot = hash_piece(piece) & index_mask;; slot = (slot + 1) & index_mask) {
      if (tok.token_index_[slot] < 0) {
        tok.token_index_[slot] = static_cast<int32_t>(id);
        break;
      }
      if (tok.id_to_token(tok.token_index_[slot]) == piece) break;
    }
  }

  // (left, right) -> (rank, merged id). A repeated pair keeps its last rank, as HF's HashMap
  // collect does.
  tok.merges_.assign(table_capacity(vocab.merges.size()), Merge{kEmptyPair, 0, -1});
  const size_t merge_mask = tok.merges_.size() - 1;
  std::string merged_piece;
  for (size_t rank = 0; rank < vocab.merges.size(); ++rank) {
    const auto& [left_piece, right_piece] = vocab.merges[rank];
    merged_piece.assign(left_piece).append(right_piece);
    const int32_t left = tok.token_to_id(left_piece), right = tok.token_to_id(right_piece);
    const int32_t merged = tok.token_to_id(merged_piece);
    if (left < 0 || right < 0 || merged < 0) {
      return make_error(ErrorCode::kInvalidArgument,
                        "merge {} (\"{}\" \"{}\") uses a piece that is not in the vocabulary", rank,
                        left_piece, right_piece);
    }
    note_chunk_joiners(merged_piece, tok.underline_joiners_, tok.newline_joiners_);
    const uint64_t key = pair_key(left, right);
    const auto merge_rank =
        vocab.merge_ranks.empty() ? static_cast<uint32_t>(rank) : vocab.merge_ranks[rank];
    for (size_t slot = mix_bits(key) & merge_mask;; slot = (slot + 1) & merge_mask) {
      Merge& entry = tok.merges_[slot];
      if (entry.pair_key == kEmptyPair || entry.pair_key == key) {
        entry = Merge{key, merge_rank, merged};
        break;
      }
    }
  }

  // Single-character pieces, the BPE's starting symbols.
  tok.bmp_char_ids_.assign(0x10000, -1);
  for (size_t id = 0; id < count; ++id) {
    if (!tok.exists_[id]) continue;
    const std::string_view piece = tok.id_to_token(static_cast<int32_t>(id));
    uint32_t code_point;
    if (piece.empty() || utf8::decode_one(piece, code_point) != piece.size()) continue;
    if (code_point < 0x10000) {
      if (tok.bmp_char_ids_[code_point] < 0)
        tok.bmp_char_ids_[code_point] = static_cast<int32_t>(id);
    } else {
      tok.astral_char_ids_.emplace(code_point, static_cast<int32_t>(id));
    }
  }
  sort_unique(tok.underline_joiners_);
  sort_unique(tok.newline_joiners_);
  tok.split_at_newlines_ = tok.char_id('\n') >= 0;
  tok.split_before_underline_ = tok.char_id(kUnderline) >= 0;
  for (int byte = 0; byte < 256; ++byte) {
    tok.byte_token_ids_[byte] = tok.token_to_id(fmt::format("<0x{:02X}>", byte));
  }
  tok.unk_id_ = vocab.unk_token.empty() ? -1 : tok.token_to_id(vocab.unk_token);

  // Added tokens, in a byte trie for leftmost-longest matching.
  tok.special_.assign(count, 0);
  tok.added_trie_.emplace_back();
  for (auto& added : vocab.added_tokens) {
    if (added.text.empty()) {
      return make_error(ErrorCode::kInvalidArgument, "added token {} has empty content", added.id);
    }
    if (added.id < 0 || static_cast<size_t>(added.id) >= count || !tok.exists_[added.id] ||
        tok.id_to_token(added.id) != added.text) {
      return make_error(ErrorCode::kInvalidArgument,
                        "added token \"{}\" (id {}) does not match the vocabulary", added.text,
                        added.id);
    }
    if (added.special) tok.special_[added.id] = 1;
    int32_t node = 0;
    for (const char c : added.text) {
      const auto byte = static_cast<uint8_t>(c);
      auto& children = tok.added_trie_[node].children;
      auto it = std::lower_bound(children.begin(), children.end(), std::pair{byte, INT32_MIN});
      if (it != children.end() && it->first == byte) {
        node = it->second;
      } else {
        const auto child = static_cast<int32_t>(tok.added_trie_.size());
        children.insert(it, {byte, child});
        tok.added_trie_.emplace_back();  // invalidates `children`: not used below
        node = child;
      }
    }
    tok.added_trie_[node].token_index = static_cast<int32_t>(tok.added_tokens_.size());
    tok.added_first_byte_[static_cast<uint8_t>(added.text[0])] = true;
    tok.added_tokens_.push_back(std::move(added));
  }
  return tok;
}

Expected<Tokenizer::LoadedVocab> Tokenizer::typed_vocab(std::vector<std::string> tokens,
                                                        std::span<const int32_t> token_types) {
  if (!token_types.empty() && token_types.size() != tokens.size()) {
    return make_error(ErrorCode::kInvalidArgument, "tokenizer has {} tokens but {} token types",
                      tokens.size(), token_types.size());
  }
  LoadedVocab vocab;
  vocab.byte_fallback = true;
  vocab.fuse_unk = true;
  vocab.exists.assign(tokens.size(), 1);
  for (size_t id = 0; id < token_types.size(); ++id) {
    const auto type = static_cast<TokenType>(token_types[id]);
    if (type == TokenType::kUnknown && vocab.unk_token.empty()) vocab.unk_token = tokens[id];
    if (type == TokenType::kControl || type == TokenType::kUnknown ||
        type == TokenType::kUserDefined) {
      vocab.added_tokens.push_back(
          AddedToken{tokens[id], static_cast<int32_t>(id), type != TokenType::kUserDefined});
    }
  }
  if (vocab.unk_token.empty() && std::find(tokens.begin(), tokens.end(), "<unk>") != tokens.end()) {
    vocab.unk_token = "<unk>";
  }
  vocab.pieces = std::move(tokens);
  return vocab;
}

Expected<Tokenizer> Tokenizer::from_vocab(std::vector<std::string> tokens,
                                          std::span<const int32_t> token_types,
                                          std::span<const std::string> merges) {
  GEMMA4_ASSIGN_OR_RETURN(LoadedVocab vocab, typed_vocab(std::move(tokens), token_types));
  vocab.merges.reserve(merges.size());
  for (size_t rank = 0; rank < merges.size(); ++rank) {
    const std::string& merge = merges[rank];
    const size_t space = merge.find(' ', 1);
    if (space == std::string::npos) {
      return make_error(ErrorCode::kInvalidArgument, "merge {} (\"{}\") has no space", rank, merge);
    }
    vocab.merges.emplace_back(merge.substr(0, space), merge.substr(space + 1));
  }
  return build(std::move(vocab));
}

Expected<Tokenizer> Tokenizer::from_scored_vocab(std::vector<std::string> tokens,
                                                 std::span<const int32_t> token_types,
                                                 std::span<const float> scores) {
  if (scores.size() != tokens.size()) {
    return make_error(ErrorCode::kInvalidArgument, "tokenizer has {} tokens but {} scores",
                      tokens.size(), scores.size());
  }
  for (size_t id = 0; id < scores.size(); ++id) {
    if (std::isnan(scores[id])) {
      return make_error(ErrorCode::kInvalidArgument, "score of token {} is NaN", id);
    }
  }
  GEMMA4_ASSIGN_OR_RETURN(LoadedVocab vocab, typed_vocab(std::move(tokens), token_types));
  // SentencePiece merges only into pieces it looks up as words: normal and user-defined ones
  // (control, unknown and byte pieces are reserved ids, never the result of a merge).
  const auto mergeable = [&](size_t id) {
    if (token_types.empty()) return true;
    const auto type = static_cast<TokenType>(token_types[id]);
    return type == TokenType::kNormal || type == TokenType::kUserDefined;
  };
  std::unordered_map<std::string_view, int32_t> mergeable_ids;  // the first id of a piece wins
  mergeable_ids.reserve(vocab.pieces.size());
  for (size_t id = 0; id < vocab.pieces.size(); ++id) {
    if (mergeable(id)) mergeable_ids.emplace(vocab.pieces[id], static_cast<int32_t>(id));
  }
  struct ScoredMerge {
    float score;
    int32_t merged_id;
    uint32_t split;  // byte length of the left piece
  };
  std::vector<ScoredMerge> scored;
  for (const auto& [piece, id] : mergeable_ids) {
    uint32_t code_point;
    for (size_t split = 0; split < piece.size();) {
      const size_t length = utf8::decode_one(piece.substr(split), code_point);
      split += std::max<size_t>(length, 1);
      if (split < piece.size() && mergeable_ids.contains(piece.substr(0, split)) &&
          mergeable_ids.contains(piece.substr(split))) {
        scored.push_back(ScoredMerge{scores[id], id, static_cast<uint32_t>(split)});
      }
    }
  }
  // Rank = position of the score among the distinct scores, highest first; ties in score share a
  // rank so that the leftmost pair wins, as in SentencePiece.
  std::sort(scored.begin(), scored.end(), [](const ScoredMerge& a, const ScoredMerge& b) {
    return a.score != b.score ? a.score > b.score : a.merged_id < b.merged_id;
  });
  vocab.merges.reserve(scored.size());
  vocab.merge_ranks.reserve(scored.size());
  uint32_t rank = 0;
  for (size_t i = 0; i < scored.size(); ++i) {
    if (i > 0 && scored[i].score != scored[i - 1].score) ++rank;
    const std::string_view piece = vocab.pieces[scored[i].merged_id];
    vocab.merges.emplace_back(piece.substr(0, scored[i].split), piece.substr(scored[i].split));
    vocab.merge_ranks.push_back(rank);
  }
  return build(std::move(vocab));
}

int32_t Tokenizer::token_to_id(std::string_view token) const {
  const size_t mask = token_index_.size() - 1;
  for (size_t slot = std::hash<std::string_view>{}(token)&mask;; slot = (slot + 1) & mask) {
    const int32_t id = token_index_[slot];
    if (id < 0 || id_to_token(id) == token) return id;
  }
}

std::string_view Tokenizer::id_to_token(int32_t id) const {
  if (!has_id(id)) return {};
  return std::string_view(token_text_)
      .substr(token_offsets_[id], token_offsets_[id + 1] - token_offsets_[id]);
}

std::string_view Tokenizer::decoded_piece(int32_t id) const {
  if (!has_id(id)) return {};
  return std::string_view(decoded_text_)
      .substr(decoded_offsets_[id], decoded_offsets_[id + 1] - decoded_offsets_[id]);
}

const Tokenizer::Merge* Tokenizer::find_merge(int32_t left, int32_t right) const {
  const uint64_t key = pair_key(left, right);
  const size_t mask = merges_.size() - 1;
  for (size_t slot = mix_bits(key) & mask;; slot = (slot + 1) & mask) {
    const Merge& entry = merges_[slot];
    if (entry.pair_key == key) return &entry;
    if (entry.pair_key == kEmptyPair) return nullptr;
  }
}

int32_t Tokenizer::char_id(uint32_t code_point) const {
  if (code_point < 0x10000) return bmp_char_ids_[code_point];
  const auto it = astral_char_ids_.find(code_point);
  return it == astral_char_ids_.end() ? -1 : it->second;
}

// The character at segment[i] after normalization, and its length in bytes; kNotText for a byte
// that does not start well-formed UTF-8.
constexpr uint32_t kNotText = 0xFFFFFFFF;
size_t Tokenizer::next_char(std::string_view segment, size_t i, uint32_t& code_point) const {
  const auto lead = static_cast<uint8_t>(segment[i]);
  size_t length = 1;
  if (lead < 0x80) {
    code_point = lead;
  } else if (length = utf8::decode_one(segment.substr(i), code_point); length == 0) {
    code_point = kNotText;
    return 1;
  }
  if (code_point == ' ' && space_to_underline_) code_point = kUnderline;
  return length;
}

// One segment between added tokens. HF runs BPE on the whole segment; cutting it into chunks at
// boundaries no merge crosses gives the same ids and lets encode_chunk cache words.
void Tokenizer::encode_segment(std::string_view segment, std::vector<int32_t>& out) const {
  uint32_t previous = kNotText, code_point;
  size_t chunk_start = 0;
  for (size_t i = 0; i < segment.size(); previous = code_point) {
    const size_t length = next_char(segment, i, code_point);
    const bool boundary = (split_at_newlines_ && (previous == '\n') != (code_point == '\n') &&
                           !contains(newline_joiners_, previous == '\n' ? code_point : previous)) ||
                          (split_before_underline_ && code_point == kUnderline &&
                           previous != kUnderline && !contains(underline_joiners_, previous));
    if (boundary && i > chunk_start) {
      encode_chunk(segment.substr(chunk_start, i - chunk_start), out);
      chunk_start = i;
    }
    i += length;
  }
  encode_chunk(segment.substr(chunk_start), out);
}

// BPE over one chunk (HF BPE::merge_word), through the per-thread cache of short chunks.
void Tokenizer::encode_chunk(std::string_view chunk, std::vector<int32_t>& out) const {
  if (chunk.empty()) return;
  ChunkCache& cache = chunk_cache;
  const bool cacheable = chunk.size() <= ChunkCache::kMaxChunkBytes;
  if (cacheable) {
    if (cache.owner != cache_id_) {
      cache.clear();
      cache.owner = cache_id_;
    }
    if (const auto hit = cache.entries.find(chunk); hit != cache.entries.end()) {
      const auto [offset, count] = hit->second;
      out.insert(out.end(), cache.ids.begin() + offset, cache.ids.begin() + offset + count);
      return;
    }
  }

  auto& symbols = bpe_workspace.symbols;
  symbols.clear();
  bool last_is_fused_unk = false;
  const auto add_symbol = [&](int32_t id) {
    const auto index = static_cast<int32_t>(symbols.size());
    symbols.push_back(Symbol{id, index - 1, index + 1});
  };
  const auto add_unknown = [&] {
    if (unk_id_ < 0 || (fuse_unk_ && last_is_fused_unk)) return;
    add_symbol(unk_id_);
    last_is_fused_unk = true;
  };
  // Byte fallback: all bytes of the character as <0xNN> tokens, or <unk> if one is missing.
  const auto add_bytes = [&](std::string_view bytes) {
    bool all_exist = byte_fallback_;
    for (const char b : bytes) {
      all_exist = all_exist && byte_token_ids_[static_cast<uint8_t>(b)] >= 0;
    }
    if (!all_exist) return add_unknown();
    for (const char b : bytes) add_symbol(byte_token_ids_[static_cast<uint8_t>(b)]);
    last_is_fused_unk = false;
  };
  std::string normalized_bytes;  // only for a character missing from the vocabulary
  for (size_t i = 0; i < chunk.size();) {
    uint32_t code_point;
    const size_t length = next_char(chunk, i, code_point);
    if (code_point == kNotText) {
      add_bytes(chunk.substr(i, 1));
    } else if (const int32_t id = char_id(code_point); id >= 0) {
      add_symbol(id);
      last_is_fused_unk = false;
    } else {
      normalized_bytes.clear();
      utf8::append(normalized_bytes, code_point);
      add_bytes(normalized_bytes);
    }
    i += length;
  }
  const size_t first_new = out.size();
  merge_and_emit(out);
  if (cacheable) cache.insert(chunk, std::span(out).subspan(first_new));
}

// BPE over the symbols gathered in the workspace (HF Word::merge_all); appends the resulting ids
// and empties the workspace.
void Tokenizer::merge_and_emit(std::vector<int32_t>& out) const {
  auto& symbols = bpe_workspace.symbols;
  auto& queue = bpe_workspace.queue;
  if (symbols.empty()) return;
  symbols.back().next = -1;
  queue.clear();
  for (size_t i = 0; i + 1 < symbols.size(); ++i) {
    if (const Merge* merge = find_merge(symbols[i].id, symbols[i + 1].id)) {
      queue.push_back(PendingMerge{merge->rank, static_cast<int32_t>(i), symbols[i].id,
                                   symbols[i + 1].id, merge->merged_id});
    }
  }
  std::make_heap(queue.begin(), queue.end(), lower_priority);
  while (!queue.empty()) {
    std::pop_heap(queue.begin(), queue.end(), lower_priority);
    const PendingMerge top = queue.back();
    queue.pop_back();
    Symbol& current = symbols[top.position];
    if (current.id < 0 || current.next < 0) continue;
    Symbol& right = symbols[current.next];
    // Skip entries made stale by an earlier merge. (HF looks the pair up again and compares the
    // merged id; that is the same test, since a merged id names the concatenated pieces.)
    if (current.id != top.left_id || right.id != top.right_id) continue;
    current.id = top.merged_id;
    current.next = right.next;
    right.id = -1;
    if (current.next >= 0) symbols[current.next].prev = top.position;
    if (current.prev >= 0) {
      if (const Merge* m = find_merge(symbols[current.prev].id, current.id)) {
        queue.push_back(PendingMerge{m->rank, current.prev, symbols[current.prev].id, current.id,
                                     m->merged_id});
        std::push_heap(queue.begin(), queue.end(), lower_priority);
      }
    }
    if (current.next >= 0) {
      if (const Merge* m = find_merge(current.id, symbols[current.next].id)) {
        queue.push_back(PendingMerge{m->rank, top.position, current.id, symbols[current.next].id,
                                     m->merged_id});
        std::push_heap(queue.begin(), queue.end(), lower_priority);
      }
    }
  }
  for (int32_t i = 0; i >= 0; i = symbols[i].next) out.push_back(symbols[i].id);
  symbols.clear();
}

std::vector<int32_t> Tokenizer::encode(std::string_view text, bool parse_special) const {
  return encode_with_added_tokens(text, parse_special, {});
}

std::vector<int32_t> Tokenizer::encode_protected(
    std::string_view text, std::span<const std::pair<size_t, size_t>> untrusted) const {
  return encode_with_added_tokens(text, /*parse_special=*/true, untrusted);
}

std::vector<int32_t> Tokenizer::encode_with_added_tokens(
    std::string_view text, bool parse_special,
    std::span<const std::pair<size_t, size_t>> untrusted) const {
  std::vector<int32_t> ids;
  size_t next_range = 0;  // first untrusted range that does not end at or before i
  ids.reserve(text.size() / 2 + 1);
  size_t plain_start = 0;
  for (size_t i = 0; i < text.size();) {
    if (!added_first_byte_[static_cast<uint8_t>(text[i])]) {
      ++i;
      continue;
    }
    // Leftmost-longest added token starting at i.
    int32_t node = 0, match = -1;
    size_t match_length = 0;
    for (size_t j = i; j < text.size(); ++j) {
      const auto& children = added_trie_[node].children;
      const auto byte = static_cast<uint8_t>(text[j]);
      auto it = std::lower_bound(children.begin(), children.end(), std::pair{byte, INT32_MIN});
      if (it == children.end() || it->first != byte) break;
      node = it->second;
      if (added_trie_[node].token_index >= 0) {
        match = added_trie_[node].token_index;
        match_length = j - i + 1;
      }
    }
    if (match < 0) {
      ++i;
      continue;
    }
    const AddedToken& added = added_tokens_[match];
    if (added.special && !parse_special) {  // stays plain text; HF resumes after the match
      i += match_length;
      continue;
    }
    if (added.special) {
      while (next_range < untrusted.size() && untrusted[next_range].second <= i) ++next_range;
      if (next_range < untrusted.size() && untrusted[next_range].first < i + match_length) {
        // Overlaps untrusted text: plain text. Inside the range this is parse_special=false
        // (resume after the match), but never past the range, so trusted text after it is
        // matched as usual; a match starting before the range only skips its first byte.
        const auto [range_begin, range_end] = untrusted[next_range];
        i = range_begin <= i ? std::min(i + match_length, range_end) : i + 1;
        continue;
      }
    }
    encode_segment(text.substr(plain_start, i - plain_start), ids);
    ids.push_back(added.id);
    i += match_length;
    plain_start = i;
  }
  encode_segment(text.substr(plain_start), ids);
  return ids;
}

std::string Tokenizer::decode(std::span<const int32_t> ids, bool skip_special) const {
  std::string text;
  size_t byte_run_start = std::string::npos;  // where the pending run of fallback bytes starts
  const auto finish_byte_run = [&] {
    if (byte_run_start == std::string::npos) return;
    utf8::finish_byte_run(text, byte_run_start);
    byte_run_start = std::string::npos;
  };
  for (const int32_t id : ids) {
    if (!has_id(id) || (skip_special && special_[id])) continue;
    if (const int16_t byte = byte_values_[id]; byte >= 0) {
      if (byte_run_start == std::string::npos) byte_run_start = text.size();
      text += static_cast<char>(byte);
      continue;
    }
    finish_byte_run();
    text += decoded_piece(id);
  }
  finish_byte_run();
  return text;
}

}  // namespace gemma4::text
