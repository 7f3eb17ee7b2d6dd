#include "engine/lm_head.h"

#include "quant/pack_w4g32.h"

namespace gemma4::engine {

const char* lm_head_format_name(LmHeadFormat format) {
  return format == LmHeadFormat::kQ8 ? "q8" : "exact";
}

Expected<LmHeadFormat> parse_lm_head_format(std::string_view name) {
  for (LmHeadFormat format : {LmHeadFormat::kExact, LmHeadFormat::kQ8}) {
    if (name == lm_head_format_name(format)) return format;
  }
  return make_error(ErrorCode::kInvalidArgument, "logits matrix format '{}': expected exact or q8",
                    name);
}

bool lm_head_quantizes(const quant::QMatrix& lm_head, LmHeadFormat format) {
  using quant::WeightFormat;
  if (format != LmHeadFormat::kQ8 || lm_head.data == nullptr || lm_head.cols % 32 != 0) {
    return false;
  }
  switch (lm_head.format) {
    case WeightFormat::kF32:
    case WeightFormat::kF16:
      return true;
    case WeightFormat::kBF16:
      return !quant::check_w4g32_exact(lm_head).ok();
    default:
      return false;
  }
}

}  // namespace gemma4::engine
