#include "planner/svg.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <string_view>
#include <vector>

namespace memplan::planner {
namespace {

// Geometry in SVG user units. Text widths are estimated at kCharWidth font sizes per character
// (generous for the generic sans-serif fonts), and text that would not fit is cut with an
// ellipsis, so that nothing overlaps whatever the model name or family.
constexpr double kMargin = 24;
constexpr double kColumnWidth = 340;  // one plan
constexpr double kMinWidth = 860;     // the title, legends and footer need this much
constexpr double kCharWidth = 0.62;
constexpr double kLegendCharWidth = 0.56;  // closer to the average, for spacing legend items

constexpr double kHeadingY = 100;  // first line of a plan's heading
constexpr double kMemLegendY = 202;
constexpr double kMemTop = 264;  // top of the memory bars' area
constexpr double kMemHeight = 170;
constexpr double kTierBarWidth = 54;
constexpr double kTierPitch = 84;  // bar width plus gap
constexpr double kTimeLegendY = 494;
constexpr double kTimeTop = 546;  // top of the step-time bars' area
constexpr double kTimeHeight = 190;
constexpr double kTimeBarWidth = 64;
constexpr double kFooterY = 772;
constexpr double kHeight = 804;

constexpr size_t kMaxRejectedShown = 8;

constexpr const char* kFont = "DejaVu Sans, Helvetica, Arial, sans-serif";
constexpr const char* kMemoryColour = "#76b7b2";
constexpr const char* kOverColour = "#e15759";
constexpr const char* kGrey = "#666666";

std::string SvgNumber(const char* format, double v) {
  if (!std::isfinite(v)) v = 0;
  char text[64];
  std::snprintf(text, sizeof(text), format, v);
  return text;
}

// A coordinate or length: two decimals, never "-0.00" or "nan".
std::string N(double v) {
  if (!std::isfinite(v) || std::fabs(v) < 0.005) v = 0;
  return SvgNumber("%.2f", v);
}

std::string Size(uint64_t bytes) {
  const double gib = static_cast<double>(bytes) / 0x1p30;
  return gib < 1024 ? SvgNumber("%.1f GiB", gib) : SvgNumber("%.2f TiB", gib / 1024);
}

// The code points of `s`; every byte that does not start a valid UTF-8 sequence (overlong forms,
// surrogates and values past U+10FFFF included) becomes U+FFFD.
std::u32string CodePoints(std::string_view s) {
  static constexpr char32_t kSmallest[] = {0, 0, 0x80, 0x800, 0x10000};
  std::u32string out;
  size_t i = 0;
  while (i < s.size()) {
    const auto lead = static_cast<unsigned char>(s[i]);
    const size_t len = lead < 0x80           ? 1
                       : (lead >> 5) == 0x6  ? 2
                       : (lead >> 4) == 0xE  ? 3
                       : (lead >> 3) == 0x1E ? 4
                                             : 0;
    char32_t cp = len == 1   ? lead
                  : len == 2 ? (lead & 0x1F)
                  : len == 3 ? (lead & 0x0F)
                             : (lead & 0x07);
    bool ok = len > 0 && i + len <= s.size();
    for (size_t k = 1; ok && k < len; ++k) {
      const auto next = static_cast<unsigned char>(s[i + k]);
      ok = (next & 0xC0) == 0x80;
      cp = (cp << 6) | (next & 0x3F);
    }
    if (ok && (cp < kSmallest[len] || (cp >= 0xD800 && cp <= 0xDFFF) || cp > 0x10FFFF)) {
      ok = false;
    }
    if (!ok) {
      out.push_back(0xFFFD);
      ++i;
      continue;
    }
    out.push_back(cp);
    i += len;
  }
  return out;
}

void AppendUtf8(char32_t cp, std::string* out) {
  if (cp < 0x80) {
    out->push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out->push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out->push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out->push_back(static_cast<char>(0xF0 | (cp >> 18)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

// XML character data (and attribute values): markup characters escaped; characters XML 1.0
// forbids (controls other than white space, U+FFFE, U+FFFF) replaced, white space made a space.
std::string Escape(std::u32string_view text) {
  std::string out;
  for (char32_t cp : text) {
    switch (cp) {
      case U'&': out += "&amp;"; break;
      case U'<': out += "&lt;"; break;
      case U'>': out += "&gt;"; break;
      case U'"': out += "&quot;"; break;
      case U'\'': out += "&#39;"; break;
      case U'\t':
      case U'\n':
      case U'\r': out += ' '; break;
      default:
        if (cp < 0x20 || cp == 0x7F || cp == 0xFFFE || cp == 0xFFFF) cp = 0xFFFD;
        AppendUtf8(cp, &out);
    }
  }
  return out;
}

std::string Escape(std::string_view text) { return Escape(CodePoints(text)); }

size_t MaxChars(double max_px, double font_px) {
  return static_cast<size_t>(std::max(1.0, max_px / (font_px * kCharWidth)));
}

// `text` escaped, cut with an ellipsis where it would be wider than `max_px` at `font_px`.
std::string Fit(std::string_view text, double max_px, double font_px) {
  std::u32string cps = CodePoints(text);
  const size_t max_chars = MaxChars(max_px, font_px);
  if (cps.size() > max_chars) {
    cps.resize(max_chars - 1);
    cps.push_back(U'\u2026');
  }
  return Escape(cps);
}

// `text` broken at spaces into at most `max_lines` lines of about `max_chars` characters (a lone
// "+" stays with the word after it, so "ZeRO-3 + optimizer on NVMe" breaks before a "+"); the
// last line takes the rest and is cut when drawn.
std::vector<std::string> Wrap(std::string_view text, size_t max_chars, size_t max_lines) {
  std::vector<std::string> words;
  size_t start = 0;
  while (start < text.size()) {
    size_t end = text.find(' ', start);
    if (end == std::string_view::npos) end = text.size();
    if (end > start) {
      std::string word(text.substr(start, end - start));
      if (!words.empty() && words.back() == "+") {
        words.back() += " " + word;
      } else {
        words.push_back(word);
      }
    }
    start = end + 1;
  }
  std::vector<std::string> lines;
  for (const std::string& word : words) {
    if (lines.empty()) {
      lines.push_back(word);
      continue;
    }
    const size_t joined = CodePoints(lines.back()).size() + 1 + CodePoints(word).size();
    if (joined <= max_chars || lines.size() == max_lines) {
      lines.back() += " " + word;
    } else {
      lines.push_back(word);
    }
  }
  return lines;
}

void Text(std::string* out, double x, double y, double size, const std::string& escaped,
          std::string_view attributes = "") {
  *out += "<text x=\"" + N(x) + "\" y=\"" + N(y) + "\" font-size=\"" + N(size) + "\"";
  if (!attributes.empty()) *out += " " + std::string(attributes);
  *out += ">" + escaped + "</text>\n";
}

void Rect(std::string* out, double x, double y, double w, double h, std::string_view attributes,
          const std::string& title = "") {
  *out += "<rect x=\"" + N(x) + "\" y=\"" + N(y) + "\" width=\"" + N(std::max(0.0, w)) +
          "\" height=\"" + N(std::max(0.0, h)) + "\" " + std::string(attributes);
  *out += title.empty() ? "/>\n" : "><title>" + Escape(title) + "</title></rect>\n";
}

void Line(std::string* out, double x1, double y1, double x2, double y2,
          std::string_view attributes) {
  *out += "<line x1=\"" + N(x1) + "\" y1=\"" + N(y1) + "\" x2=\"" + N(x2) + "\" y2=\"" + N(y2) +
          "\" " + std::string(attributes) + "/>\n";
}

// A legend item's label right of its 14-wide swatch at `*x`; moves `*x` past it.
void LegendLabel(std::string* out, double* x, double y, std::string_view label) {
  Text(out, *x + 19, y, 10.5, Escape(label));
  *x += 19 + static_cast<double>(CodePoints(label).size()) * 10.5 * kLegendCharWidth + 16;
}

std::string ClusterPhrase(const Cluster& c) {
  return std::to_string(c.nodes) + (c.nodes == 1 ? " node x " : " nodes x ") +
         std::to_string(c.gpus_per_node) + " " + c.gpu.name + " (" + Size(c.gpu.memory_bytes) + ")";
}

// The document's start: title, subtitle (batch, RAM, NVMe) and a white background.
void Open(std::string* out, double width, double height, const PlanResult& r, const Cluster& c,
          const Job& job) {
  const std::string title = "memplan plan: " + job.model + " on " + ClusterPhrase(c);
  const int64_t seq_len = r.seq_len > 0 ? r.seq_len : job.setup.seq_len;
  std::string subtitle =
      "Global batch " + std::to_string(job.global_batch) +
      (seq_len > 0 ? " x " + std::to_string(seq_len) + " tokens" : "") + " \u00b7 " +
      (c.cpu_memory_bytes > 0 ? Size(c.cpu_memory_bytes) + " RAM per node"
                              : std::string("RAM not given")) +
      " \u00b7 " +
      (c.nvme_path.empty()
           ? std::string("no NVMe drive")
           : "NVMe at " + c.nvme_path +
                 (c.nvme_capacity_bytes > 0 ? " (" + Size(c.nvme_capacity_bytes) + ")"
                                            : std::string(", capacity not given")));
  *out += "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n";
  *out += "<svg xmlns=\"http://www.w3.org/2000/svg\" version=\"1.1\" width=\"" + N(width) +
          "\" height=\"" + N(height) + "\" viewBox=\"0 0 " + N(width) + " " + N(height) +
          "\" font-family=\"" + kFont + "\">\n";
  *out += "<title>" + Escape(title) + "</title>\n";
  *out +=
      "<desc>Predictions from memplan's memory and step-time models, not measurements.</desc>\n";
  Rect(out, 0, 0, width, height, "fill=\"#ffffff\"");
  const double text_width = width - 2 * kMargin;
  Text(out, kMargin, 32, 18, Fit(title, text_width, 18), "font-weight=\"bold\"");
  Text(out, kMargin, 52, 12, Fit(subtitle, text_width, 12));
}

// The footer and the end of the document; `plans`: the picture shows plans (not "nothing fits").
void Close(std::string* out, double width, double footer_y, bool plans) {
  const double text_width = width - 2 * kMargin;
  const std::string colour = std::string("fill=\"") + kGrey + "\"";
  Text(out, kMargin, footer_y, 10,
       Fit("These are predictions from memplan's model, not measurements (planner/search.h: Note "
           "[Feasibility], Note [Step-time model]).",
           text_width, 10),
       colour);
  if (plans) {
    Text(out, kMargin, footer_y + 15, 10,
         Fit("Memory is at the plan's peak phase; step time counts only what is not hidden behind "
             "compute (exposed communication and transfers).",
             text_width, 10),
         colour);
  }
  *out += "</svg>\n";
}

std::string NothingFits(const PlanResult& r, const Cluster& c, const Job& job) {
  constexpr double kWidth = 900;
  const size_t listed = std::min(r.rejected.size(), kMaxRejectedShown);
  const bool more = r.rejected.size() > listed;
  const double list_y = 162;
  const double footer_y = list_y + 22.0 * static_cast<double>(listed + (more ? 1 : 0)) + 30;
  std::string out;
  Open(&out, kWidth, footer_y + 30, r, c, job);
  out += "<g id=\"nothing-fits\">\n";
  Text(&out, kMargin, 100, 18, "No configuration fits.",
       std::string("font-weight=\"bold\" fill=\"") + kOverColour + "\"");
  const std::string heading = r.rejected.empty()
                                  ? std::string("No family was tried.")
                                  : "Rejected families" +
                                        (more ? " (the first " + std::to_string(listed) + " of " +
                                                    std::to_string(r.rejected.size()) + ")"
                                              : std::string()) +
                                        ", and why:";
  Text(&out, kMargin, 132, 13, Fit(heading, kWidth - 2 * kMargin, 13), "font-weight=\"bold\"");
  constexpr double kFamilyWidth = 340;
  for (size_t i = 0; i < listed; ++i) {
    const Rejection& x = r.rejected[i];
    const double y = list_y + 22.0 * static_cast<double>(i);
    out += "<g class=\"rejected\"><title>" + Escape(x.plan + ": " + x.reason) + "</title>\n";
    Text(&out, kMargin, y, 12, Fit(x.plan, kFamilyWidth - 10, 12), "font-weight=\"bold\"");
    Text(&out, kMargin + kFamilyWidth, y, 12,
         Fit(x.reason, kWidth - 2 * kMargin - kFamilyWidth, 12));
    out += "</g>\n";
  }
  if (more) {
    Text(&out, kMargin, list_y + 22.0 * static_cast<double>(listed), 12,
         Escape("\u2026 and " + std::to_string(r.rejected.size() - listed) +
                " more: see the text or JSON report"),
         std::string("fill=\"") + kGrey + "\"");
  }
  out += "</g>\n";
  Close(&out, kWidth, footer_y, false);
  return out;
}

struct Tier {
  const char* key;   // the group's id suffix
  const char* name;  // "GPU"
  const char* per;   // "per GPU", "per node"
  uint64_t used = 0;
  uint64_t capacity = 0;  // 0: not given
  uint64_t usable = 0;    // the fit limit of Note [Feasibility]; 0: not checked
};

// The limits are those of Note [Feasibility] (SearchPlans computes them the same way).
std::vector<Tier> Tiers(const Plan& p, const Cluster& c, const SearchOptions& o) {
  const double ram = static_cast<double>(c.cpu_memory_bytes);
  uint64_t cpu_usable = 0;
  uint64_t pinned_usable = 0;
  uint64_t nvme_usable = 0;
  if (c.cpu_memory_bytes > 0) {
    cpu_usable = static_cast<uint64_t>(
        std::max(ram * o.cpu_usable_fraction - static_cast<double>(o.cpu_per_process_bytes) *
                                                   static_cast<double>(c.gpus_per_node),
                 1.0));
    pinned_usable = static_cast<uint64_t>(ram * o.pinned_fraction);
  }
  if (c.nvme_capacity_bytes > 0) {
    nvme_usable =
        static_cast<uint64_t>(static_cast<double>(c.nvme_capacity_bytes) * o.nvme_usable_fraction);
  }
  return {
      {"gpu", "GPU", "per GPU", p.peak.gpu_bytes, c.gpu.memory_bytes, p.gpu_capacity_bytes},
      {"cpu", "CPU", "per node", p.peak.cpu_bytes, c.cpu_memory_bytes, cpu_usable},
      {"pinned", "pinned", "per node", p.peak.pinned_bytes, c.cpu_memory_bytes, pinned_usable},
      {"nvme", "NVMe", "per node", p.peak.nvme_bytes, c.nvme_capacity_bytes, nvme_usable},
  };
}

void DrawTier(std::string* out, const std::string& id, const Tier& t, double x) {
  const double bottom = kMemTop + kMemHeight;
  const double cx = x + kTierBarWidth / 2;
  const bool known = t.capacity > 0;
  const bool over_capacity = known && t.used > t.capacity;
  const bool over_limit = !over_capacity && t.usable > 0 && t.used > t.usable;
  std::string title = std::string(t.name) + " " + t.per + ": " + Size(t.used) + " at peak";
  std::string klass = "tier";
  if (known) {
    title += " of " + Size(t.capacity);
    if (t.usable > 0) title += " (" + Size(t.usable) + " usable)";
  } else {
    title += "; no capacity given";
    klass += " no-capacity";
  }
  if (over_capacity) {
    title += ": over capacity";
    klass += " over-capacity";
  } else if (over_limit) {
    title += ": over the usable limit";
    klass += " over-limit";
  }
  *out += "<g id=\"" + id + "\" class=\"" + klass + "\"><title>" + Escape(title) + "</title>\n";
  Text(out, cx, kMemTop - 22, 10.5, Fit(Size(t.used), kTierPitch - 4, 10.5),
       "text-anchor=\"middle\" font-weight=\"bold\"");
  const std::string red = std::string("fill=\"") + kOverColour + "\"";
  if (over_capacity) {
    Text(out, cx, kMemTop - 8, 9.5, Fit("over " + Size(t.capacity), kTierPitch - 4, 9.5),
         "text-anchor=\"middle\" font-weight=\"bold\" " + red);
  } else if (over_limit) {
    Text(out, cx, kMemTop - 8, 9.5, "over usable", "text-anchor=\"middle\" " + red);
  } else if (known) {
    Text(out, cx, kMemTop - 8, 9.5, Fit("of " + Size(t.capacity), kTierPitch - 4, 9.5),
         std::string("text-anchor=\"middle\" fill=\"") + kGrey + "\"");
  }
  if (known) {
    const double scale = kMemHeight / static_cast<double>(std::max(t.capacity, t.used));
    const double used_h = static_cast<double>(t.used) * scale;
    const double capacity_h = static_cast<double>(t.capacity) * scale;
    Rect(out, x, bottom - used_h, kTierBarWidth, used_h,
         std::string("class=\"used\" fill=\"") +
             (over_capacity || over_limit ? kOverColour : kMemoryColour) + "\"");
    Rect(out, x, bottom - capacity_h, kTierBarWidth, capacity_h,
         "class=\"capacity\" fill=\"none\" stroke=\"#333333\" stroke-width=\"1.5\"");
    if (t.usable > 0 && t.usable < t.capacity) {
      const double y = bottom - static_cast<double>(t.usable) * scale;
      Line(out, x - 5, y, x + kTierBarWidth + 5, y,
           "class=\"limit\" stroke=\"#333333\" stroke-width=\"1.2\" stroke-dasharray=\"4 3\"");
    }
  } else {
    Rect(out, x, kMemTop, kTierBarWidth, kMemHeight,
         "class=\"capacity\" fill=\"#f4f4f4\" stroke=\"#999999\" stroke-dasharray=\"4 3\"");
    const double cy = kMemTop + kMemHeight / 2;
    Text(out, cx + 4, cy, 10, "no capacity given",
         "text-anchor=\"middle\" transform=\"rotate(-90 " + N(cx + 4) + " " + N(cy) +
             ")\" fill=\"" + kGrey + "\"");
  }
  Text(out, cx, bottom + 15, 11, Escape(t.name), "text-anchor=\"middle\" font-weight=\"bold\"");
  Text(out, cx, bottom + 28, 9.5, Fit(t.per, kTierPitch - 2, 9.5),
       std::string("text-anchor=\"middle\" fill=\"") + kGrey + "\"");
  *out += "</g>\n";
}

struct Part {
  const char* key;    // the segment's id suffix
  const char* name;   // in the legend
  const char* label;  // beside each bar
  const char* colour;
};
constexpr Part kParts[] = {
    {"compute", "compute", "compute", "#4e79a7"},
    {"comm", "communication", "communication", "#f28e2b"},
    {"offload", "offload (PCIe + NVMe)", "offload", "#59a14f"},
    {"optimizer", "optimizer step", "optimizer", "#b07aa1"},
};

// compute, exposed communication, exposed offload, the optimizer phase: they add up to total_s.
std::vector<double> Split(const StepTime& t) {
  return {t.compute_s, t.exposed_comm_s, t.exposed_offload_s, t.exposed_optimizer_s};
}

void DrawPlan(std::string* out, const Plan& p, size_t rank, double x0, double seconds_scale,
              const Cluster& c, const SearchOptions& options) {
  const std::string id = "plan-" + std::to_string(rank);
  const double inner = kColumnWidth - 16;
  const std::string config = "micro-batch " + std::to_string(p.setup.micro_batch) +
                             " x grad-accum " + std::to_string(p.setup.grad_accum);
  const std::string checkpointing =
      "checkpointing: " + std::string(estimator::CheckpointingName(p.setup.checkpointing)) +
      (!p.setup.pin_memory && (p.setup.offload_optimizer != estimator::OffloadDevice::kNone ||
                               p.setup.offload_param != estimator::OffloadDevice::kNone)
           ? " \u00b7 pin_memory off"
           : "");
  const std::string speed = SvgNumber("%.0f tokens/s", p.tokens_per_s) + " \u00b7 " +
                            SvgNumber("%.2f s/step", p.time.total_s) + " \u00b7 " +
                            SvgNumber("MFU %.0f%%", p.mfu * 100);
  *out += "<g id=\"" + id + "\" class=\"plan\">\n<title>" +
          Escape("#" + std::to_string(rank) + " " + p.family + ": " + config + ", " +
                 checkpointing + "; " + speed) +
          "</title>\n";
  if (rank > 1) {
    // Between columns, broken where the legends run across the whole width.
    const char* grey = "stroke=\"#dddddd\"";
    Line(out, x0, 84, x0, kMemLegendY - 18, grey);
    Line(out, x0, kMemLegendY + 30, x0, kTimeLegendY - 18, grey);
    Line(out, x0, kTimeLegendY + 30, x0, kFooterY - 22, grey);
  }

  const std::vector<std::string> heading =
      Wrap("#" + std::to_string(rank) + " " + p.family, MaxChars(inner, 14), 2);
  for (size_t i = 0; i < heading.size(); ++i) {
    Text(out, x0 + 8, kHeadingY + 17.0 * static_cast<double>(i), 14, Fit(heading[i], inner, 14),
         "class=\"family\" font-weight=\"bold\"");
  }
  Text(out, x0 + 8, kHeadingY + 37, 11.5, Fit(config, inner, 11.5));
  Text(out, x0 + 8, kHeadingY + 53, 11.5, Fit(checkpointing, inner, 11.5));
  Text(out, x0 + 8, kHeadingY + 71, 12, Fit(speed, inner, 12), "font-weight=\"bold\"");

  // Memory per tier.
  const double tiers_x = x0 + (kColumnWidth - (3 * kTierPitch + kTierBarWidth)) / 2;
  const std::vector<Tier> tiers = Tiers(p, c, options);
  for (size_t i = 0; i < tiers.size(); ++i) {
    DrawTier(out, id + "-" + tiers[i].key, tiers[i], tiers_x + kTierPitch * static_cast<double>(i));
  }

  // Step time, stacked bottom-up.
  const double bottom = kTimeTop + kTimeHeight;
  const double bar_x = x0 + 24;
  Line(out, bar_x - 8, bottom, bar_x + kTimeBarWidth + 8, bottom, "stroke=\"#333333\"");
  const std::vector<double> split = Split(p.time);
  double y = bottom;
  for (size_t i = 0; i < split.size(); ++i) {
    const double h = std::max(0.0, split[i]) * seconds_scale;
    y -= h;
    Rect(out, bar_x, y, kTimeBarWidth, h,
         std::string("id=\"") + id + "-" + kParts[i].key + "\" class=\"segment\" fill=\"" +
             kParts[i].colour + "\"",
         std::string(kParts[i].name) + ": " + SvgNumber("%.2f s", split[i]));
  }
  Text(out, bar_x + kTimeBarWidth / 2, y - 6, 11.5, SvgNumber("%.2f s", p.time.total_s),
       "text-anchor=\"middle\" font-weight=\"bold\"");
  const double list_x = x0 + 112;
  const double list_width = kColumnWidth - 112 - 8;
  for (size_t i = 0; i < split.size(); ++i) {
    const double ly = kTimeTop + 14 + 19.0 * static_cast<double>(i);
    Rect(out, list_x, ly - 9, 10, 10, std::string("fill=\"") + kParts[i].colour + "\"");
    const double share = p.time.total_s > 0 ? 100 * split[i] / p.time.total_s : 0;
    Text(out, list_x + 15, ly, 11,
         Fit(std::string(kParts[i].label) + " " + SvgNumber("%.2f s", split[i]) + " (" +
                 SvgNumber("%.0f%%", share) + ")",
             list_width - 15, 11));
  }
  Text(out, list_x, kTimeTop + 14 + 19.0 * 4 + 4, 10.5,
       Fit("bound by " + p.time.bound, list_width, 10.5), std::string("fill=\"") + kGrey + "\"");
  *out += "</g>\n";
}

}  // namespace

std::string PlansSvg(const PlanResult& r, const Cluster& c, const Job& job, size_t top,
                     const SearchOptions& options) {
  const size_t shown = std::min(std::max<size_t>(top, 1), r.plans.size());
  if (shown == 0) return NothingFits(r, c, job);
  const double width = std::max(kMinWidth, 2 * kMargin + static_cast<double>(shown) * kColumnWidth);
  const double text_width = width - 2 * kMargin;
  std::string out;
  Open(&out, width, kHeight, r, c, job);
  std::string summary = "Top " + std::to_string(shown) + " of " + std::to_string(r.plans.size()) +
                        (r.plans.size() == 1 ? " plan" : " plans") +
                        " that fit, fastest first (one per ZeRO stage + offload family)";
  if (!r.rejected.empty()) {
    summary += " \u00b7 " + std::to_string(r.rejected.size()) +
               (r.rejected.size() == 1 ? " family does" : " families do") +
               " not fit: see the text or JSON report";
  }
  Text(&out, kMargin, 69, 11, Fit(summary, text_width, 11), std::string("fill=\"") + kGrey + "\"");

  // Legends, once for all plans.
  const std::string bold = "font-weight=\"bold\"";
  Text(&out, kMargin, kMemLegendY, 13, "Peak memory per tier against its capacity", bold);
  {
    double x = kMargin;
    const double y = kMemLegendY + 20;
    Rect(&out, x, y - 9, 14, 10, std::string("fill=\"") + kMemoryColour + "\"");
    LegendLabel(&out, &x, y, "predicted peak");
    Rect(&out, x, y - 9, 14, 10, "fill=\"none\" stroke=\"#333333\" stroke-width=\"1.5\"");
    LegendLabel(&out, &x, y, "capacity");
    Line(&out, x, y - 4, x + 14, y - 4, "stroke=\"#333333\" stroke-dasharray=\"4 3\"");
    LegendLabel(&out, &x, y, "usable limit (what the search fits against)");
    Rect(&out, x, y - 9, 14, 10, std::string("fill=\"") + kOverColour + "\"");
    LegendLabel(&out, &x, y, "over the limit");
  }
  double max_total = 0;
  for (size_t i = 0; i < shown; ++i) {
    double sum = 0;
    for (double s : Split(r.plans[i].time)) sum += std::max(0.0, s);
    max_total = std::max({max_total, sum, r.plans[i].time.total_s});
  }
  const double seconds_scale = max_total > 0 ? kTimeHeight / max_total : 0;
  Text(&out, kMargin, kTimeLegendY, 13,
       Fit("Predicted step time (one scale for all plans: the tallest bar is " +
               SvgNumber("%.2f s", max_total) + ")",
           text_width, 13),
       bold);
  {
    double x = kMargin;
    const double y = kTimeLegendY + 20;
    for (const Part& part : kParts) {
      Rect(&out, x, y - 9, 14, 10, std::string("fill=\"") + part.colour + "\"");
      LegendLabel(&out, &x, y, part.name);
    }
  }

  for (size_t i = 0; i < shown; ++i) {
    const Plan& p = r.plans[i];
    const double x0 = kMargin + static_cast<double>(i) * kColumnWidth;
    DrawPlan(&out, p, i + 1, x0, seconds_scale, c, options);
  }
  Close(&out, width, kFooterY, true);
  return out;
}

namespace {

// One colour per GPU type (Tableau 10), in the order the types were given.
constexpr const char* kTypeColours[] = {"#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#b07aa1",
                                        "#76b7b2", "#edc948", "#ff9da7", "#9c755f", "#bab0ac"};

// Decade ticks of a log axis over [lo, hi]: 1, 2, 5 x 10^k when few decades, else 10^k.
std::vector<double> LogTicks(double lo, double hi) {
  std::vector<double> ticks;
  const int first = static_cast<int>(std::floor(std::log10(lo)));
  const int last = static_cast<int>(std::ceil(std::log10(hi)));
  const bool fine = last - first <= 3;
  for (int e = first; e <= last; ++e) {
    for (double m : {1.0, 2.0, 5.0}) {
      if (!fine && m != 1.0) continue;
      const double v = m * std::pow(10.0, e);
      if (v >= lo * 0.999 && v <= hi * 1.001) ticks.push_back(v);
    }
  }
  return ticks;
}

std::string Compact(double v) {
  if (v >= 1e9) return SvgNumber("%.3g", v / 1e9) + "G";
  if (v >= 1e6) return SvgNumber("%.3g", v / 1e6) + "M";
  if (v >= 1e3) return SvgNumber("%.3g", v / 1e3) + "k";
  return SvgNumber("%.3g", v);
}

}  // namespace

std::string CapacitySvg(const CapacityResult& r, const CapacityRequest& request, const Job& job) {
  constexpr double kWidth = 900, kHeightC = 640;
  constexpr double kLeft = 96, kRight = 200, kTop = 96, kBottom = 96;
  const double plot_w = kWidth - kLeft - kRight, plot_h = kHeightC - kTop - kBottom;
  const bool by_cost = !r.cheapest_by_gpu_hours;
  std::string out;
  const std::string title = "memplan capacity: " + job.model + ", " +
                            SvgNumber("%.4g", request.tokens / 1e9) + "B tokens";
  out += "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n";
  out += "<svg xmlns=\"http://www.w3.org/2000/svg\" version=\"1.1\" width=\"" + N(kWidth) +
         "\" height=\"" + N(kHeightC) + "\" viewBox=\"0 0 " + N(kWidth) + " " + N(kHeightC) +
         "\" font-family=\"" + kFont + "\">\n";
  out += "<title>" + Escape(title) + "</title>\n";
  out += "<desc>Predictions from memplan's memory and step-time models, not measurements.</desc>\n";
  Rect(&out, 0, 0, kWidth, kHeightC, "fill=\"#ffffff\"");
  Text(&out, kMargin, 32, 18, Fit(title, kWidth - 2 * kMargin, 18), "font-weight=\"bold\"");
  const std::string subtitle =
      std::string(by_cost ? "Cost" : "GPU-hours (no price given)") +
      " against time to train, one point per GPU type x count that fits (labelled with the GPU "
      "count); global batch " +
      std::to_string(job.global_batch) + " x " + std::to_string(r.seq_len) + " tokens";
  Text(&out, kMargin, 52, 12, Fit(subtitle, kWidth - 2 * kMargin, 12));

  std::vector<size_t> shown;
  for (size_t i = 0; i < r.points.size(); ++i) {
    const CapacityPoint& p = r.points[i];
    const double y = by_cost ? p.cost : p.gpu_hours;
    if (p.fits && p.train_hours > 0 && y > 0 && (!by_cost || p.priced)) shown.push_back(i);
  }
  if (shown.empty()) {
    Text(&out, kMargin, 96, 14,
         Escape(r.fewest ? "No priced GPU type fits: give --price for the types that do."
                         : "No GPU type and count fits: see the text or JSON report for why."),
         "font-weight=\"bold\"");
    out += "</svg>\n";
    return out;
  }
  double x_lo = 1e300, x_hi = 0, y_lo = 1e300, y_hi = 0;
  for (size_t i : shown) {
    const CapacityPoint& p = r.points[i];
    const double days = p.train_hours / 24, y = by_cost ? p.cost : p.gpu_hours;
    x_lo = std::min(x_lo, days);
    x_hi = std::max(x_hi, days);
    y_lo = std::min(y_lo, y);
    y_hi = std::max(y_hi, y);
  }
  // Whole decades around the data (at least one decade each way).
  auto widen = [](double* lo, double* hi) {
    *lo = std::pow(10.0, std::floor(std::log10(*lo)));
    *hi = std::pow(10.0, std::ceil(std::log10(*hi)));
    if (*hi <= *lo * 1.0001) *hi = *lo * 10;
  };
  widen(&x_lo, &x_hi);
  widen(&y_lo, &y_hi);
  auto px = [&](double v) {
    return kLeft +
           (std::log10(v) - std::log10(x_lo)) / (std::log10(x_hi) - std::log10(x_lo)) * plot_w;
  };
  auto py = [&](double v) {
    return kTop + plot_h -
           (std::log10(v) - std::log10(y_lo)) / (std::log10(y_hi) - std::log10(y_lo)) * plot_h;
  };
  Rect(&out, kLeft, kTop, plot_w, plot_h, "fill=\"none\" stroke=\"#333333\" stroke-width=\"1\"");
  const std::string grey = std::string("fill=\"") + kGrey + "\"";
  for (double t : LogTicks(x_lo, x_hi)) {
    Line(&out, px(t), kTop, px(t), kTop + plot_h, "stroke=\"#dddddd\"");
    Text(&out, px(t), kTop + plot_h + 16, 10.5, Escape(Compact(t)),
         "text-anchor=\"middle\" " + grey);
  }
  for (double t : LogTicks(y_lo, y_hi)) {
    Line(&out, kLeft, py(t), kLeft + plot_w, py(t), "stroke=\"#dddddd\"");
    Text(&out, kLeft - 6, py(t) + 4, 10.5, Escape(Compact(t)), "text-anchor=\"end\" " + grey);
  }
  Text(&out, kLeft + plot_w / 2, kTop + plot_h + 36, 12, "Time to train (days, log scale)",
       "text-anchor=\"middle\"");
  Text(&out, 20, kTop + plot_h / 2, 12, by_cost ? "Cost (log scale)" : "GPU-hours (log scale)",
       "text-anchor=\"middle\" transform=\"rotate(-90 20 " + N(kTop + plot_h / 2) + ")\"");

  // Points, then the three answers ringed and named.
  for (size_t i : shown) {
    const CapacityPoint& p = r.points[i];
    const char* colour = kTypeColours[p.offer % (sizeof(kTypeColours) / sizeof(kTypeColours[0]))];
    const double x = px(p.train_hours / 24), y = py(by_cost ? p.cost : p.gpu_hours);
    out += "<circle cx=\"" + N(x) + "\" cy=\"" + N(y) + "\" r=\"5\" fill=\"" + colour +
           "\"><title>" +
           Escape(std::to_string(p.gpus) + " x " + p.gpu + ": " +
                  SvgNumber("%.1f days", p.train_hours / 24) +
                  (p.priced ? ", cost " + SvgNumber("%.0f", p.cost) : std::string()) + ", " +
                  (p.plan ? p.plan->family : std::string())) +
           "</title></circle>\n";
    Text(&out, x + 7, y - 5, 9, Escape(std::to_string(p.gpus)), grey);
  }
  struct Answer {
    const std::optional<size_t>& index;
    const char* name;
  };
  const Answer answers[] = {{r.fewest, "fewest GPUs"},
                            {r.fastest, "fastest"},
                            {r.cheapest, by_cost ? "cheapest" : "fewest GPU-hours"}};
  double label_y = kTop + 12;
  for (const Answer& a : answers) {
    if (!a.index || std::find(shown.begin(), shown.end(), *a.index) == shown.end()) continue;
    const CapacityPoint& p = r.points[*a.index];
    const double x = px(p.train_hours / 24), y = py(by_cost ? p.cost : p.gpu_hours);
    out += "<circle cx=\"" + N(x) + "\" cy=\"" + N(y) +
           "\" r=\"10\" fill=\"none\" stroke=\"#333333\" stroke-width=\"1.5\"/>\n";
    const double lx = kLeft + plot_w + 16;
    Line(&out, x + 10, y, lx - 4, label_y - 4, "stroke=\"#999999\" stroke-dasharray=\"3 3\"");
    Text(&out, lx, label_y, 11,
         Fit(std::string(a.name) + ": " + std::to_string(p.gpus) + " x " + p.gpu, kRight - 24, 11),
         "font-weight=\"bold\"");
    Text(&out, lx, label_y + 14, 10,
         Fit(SvgNumber("%.1f days", p.train_hours / 24) +
                 (p.priced ? ", " + Compact(p.cost) : ", " + Compact(p.gpu_hours) + " GPU-h"),
             kRight - 24, 10),
         grey);
    label_y += 40;
  }
  // Legend of GPU types.
  double ly = label_y + 10;
  for (size_t o = 0; o < request.offers.size(); ++o) {
    const char* colour = kTypeColours[o % (sizeof(kTypeColours) / sizeof(kTypeColours[0]))];
    const double lx = kLeft + plot_w + 16;
    out += "<circle cx=\"" + N(lx + 5) + "\" cy=\"" + N(ly - 4) + "\" r=\"5\" fill=\"" + colour +
           "\"/>\n";
    const GpuOffer& offer = request.offers[o];
    Text(&out, lx + 16, ly, 10.5,
         Fit(offer.gpu.name + (offer.price_per_gpu_hour > 0
                                   ? " @ " + SvgNumber("%.2f", offer.price_per_gpu_hour) + "/GPU-h"
                                   : std::string(" (no price)")),
             kRight - 36, 10.5));
    ly += 18;
  }
  const size_t missing = r.points.size() - shown.size();
  Text(&out, kMargin, kHeightC - 40, 10,
       Fit(std::to_string(missing) + " of " + std::to_string(r.points.size()) +
               " GPU type x count points are not drawn (they do not fit, cannot run, or have no "
               "price): see the text or JSON report.",
           kWidth - 2 * kMargin, 10),
       grey);
  Text(&out, kMargin, kHeightC - 24, 10,
       Fit("These are predictions from memplan's model, not measurements (planner/capacity.h: "
           "Note [Capacity search]).",
           kWidth - 2 * kMargin, 10),
       grey);
  out += "</svg>\n";
  return out;
}

}  // namespace memplan::planner
