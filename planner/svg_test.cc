// PlansSvg: a well-formed standalone document (checked with a small tag-balance parser), one group
// per plan with its family, step-time segments whose heights follow the time split, tiers over
// capacity marked, user text escaped, and byte-identical output for the same input.
#include "planner/svg.h"

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

namespace memplan::planner {
namespace {

constexpr uint64_t kGiB = uint64_t{1} << 30;

// Empty when `xml` is an XML declaration followed by exactly one element whose start and end tags
// all balance, with quoted attributes and only the five entities the writer uses; otherwise the
// first problem found.
std::string CheckWellFormed(const std::string& xml) {
  if (xml.rfind("<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<svg ", 0) != 0) {
    return "does not start with the XML declaration and <svg";
  }
  std::vector<std::string> open;
  int roots = 0;
  size_t i = 0;
  while (i < xml.size()) {
    if (xml[i] != '<') {
      if (xml[i] == '&') {
        bool known = false;
        for (const char* entity : {"&amp;", "&lt;", "&gt;", "&quot;", "&#39;"}) {
          known = known || xml.compare(i, std::string(entity).size(), entity) == 0;
        }
        if (!known) return "bare & at " + std::to_string(i);
      } else if (xml[i] == '>') {
        return "bare > at " + std::to_string(i);
      } else if (open.empty() && xml[i] != '\n') {
        return "text outside the root element at " + std::to_string(i);
      }
      ++i;
      continue;
    }
    const size_t end = xml.find('>', i);
    if (end == std::string::npos) return "unterminated tag at " + std::to_string(i);
    const std::string tag = xml.substr(i + 1, end - i - 1);
    i = end + 1;
    if (tag.empty()) return "empty tag";
    if (tag.find('<') != std::string::npos) return "< inside a tag: " + tag;
    if (std::count(tag.begin(), tag.end(), '"') % 2 != 0) return "unbalanced quotes: " + tag;
    if (tag.front() == '?') {
      if (roots > 0 || !open.empty() || tag.back() != '?') return "misplaced <?" + tag;
      continue;
    }
    if (tag.front() == '!') return "unexpected <!: " + tag;
    if (tag.front() == '/') {
      const std::string name = tag.substr(1);
      if (open.empty() || open.back() != name) {
        return "</" + name + "> closes <" + (open.empty() ? std::string() : open.back()) + ">";
      }
      open.pop_back();
      continue;
    }
    const std::string name = tag.substr(0, tag.find_first_of(" \n/"));
    if (name.empty()) return "nameless tag: " + tag;
    if (open.empty() && ++roots > 1) return "a second root element <" + name + ">";
    if (tag.back() != '/') open.push_back(name);
  }
  if (!open.empty()) return "<" + open.back() + "> never closed";
  return roots == 1 ? "" : "no root element";
}

// From the start tag of the element with id="`id`" to its end tag; empty when there is none.
std::string Element(const std::string& svg, const std::string& id) {
  const size_t at = svg.find(" id=\"" + id + "\"");
  if (at == std::string::npos) return "";
  const size_t start = svg.rfind('<', at);
  const std::string name = svg.substr(start + 1, svg.find(' ', start) - start - 1);
  const size_t start_end = svg.find('>', at);
  if (svg[start_end - 1] == '/') return svg.substr(start, start_end - start + 1);
  int depth = 0;
  for (size_t i = start; i < svg.size(); i = svg.find('<', i + 1)) {
    if (svg.compare(i, name.size() + 3, "</" + name + ">") == 0) {
      if (--depth == 0) return svg.substr(start, i + name.size() + 3 - start);
    } else if (svg.compare(i, name.size() + 2, "<" + name + " ") == 0 &&
               svg[svg.find('>', i) - 1] != '/') {
      ++depth;
    }
  }
  return "";
}

// The number in attribute `name` of the first tag of `element`.
double Number(const std::string& element, const std::string& name) {
  const std::string tag = element.substr(0, element.find('>'));
  const size_t at = tag.find(" " + name + "=\"");
  REQUIRE_MESSAGE(at != std::string::npos, name << " not in " << tag);
  return std::stod(tag.substr(at + name.size() + 3));
}

std::string ClassOf(const std::string& element) {
  const std::string tag = element.substr(0, element.find('>'));
  const size_t at = tag.find(" class=\"");
  if (at == std::string::npos) return "";
  return tag.substr(at + 8, tag.find('"', at + 8) - at - 8);
}

size_t Count(const std::string& text, const std::string& what) {
  size_t n = 0;
  for (size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
  return n;
}

// The text of the elements with class="family" in `element`, joined by spaces.
std::string FamilyText(const std::string& element) {
  std::string out;
  for (size_t at = element.find("class=\"family\""); at != std::string::npos;
       at = element.find("class=\"family\"", at + 1)) {
    const size_t start = element.find('>', at) + 1;
    out += (out.empty() ? "" : " ") + element.substr(start, element.find("</text>", start) - start);
  }
  return out;
}

Cluster TestCluster() {
  Cluster c;
  c.gpu = *FindGpuPreset("a100-80");
  c.gpus_per_node = 8;
  c.cpu_memory_bytes = 1024 * kGiB;
  c.nvme_path = "/mnt/nvme";
  c.nvme_capacity_bytes = 4096 * kGiB;
  return c;
}

Job TestJob() {
  Job job;
  job.model = "llama-2-70b";
  job.global_batch = 64;
  job.setup.seq_len = 2048;
  return job;
}

Plan MakePlan(const std::string& family, double compute, double comm, double offload,
              double optimizer) {
  Plan p;
  p.family = family;
  p.setup.zero_stage = 3;
  p.setup.micro_batch = 2;
  p.setup.grad_accum = 4;
  p.peak.gpu_bytes = 60 * kGiB;
  p.peak.cpu_bytes = 300 * kGiB;
  p.peak.pinned_bytes = 100 * kGiB;
  p.peak.nvme_bytes = 800 * kGiB;
  p.gpu_capacity_bytes = 76 * kGiB;
  p.time.compute_s = compute;
  p.time.exposed_comm_s = comm;
  p.time.exposed_offload_s = offload;
  p.time.exposed_optimizer_s = optimizer;
  p.time.total_s = compute + comm + offload + optimizer;
  p.time.bound = "compute";
  p.tokens_per_s = 64.0 * 2048 / p.time.total_s;
  return p;
}

PlanResult ThreePlans() {
  PlanResult r;
  r.seq_len = 2048;
  r.plans = {MakePlan("ZeRO-3 + optimizer on NVMe + params on CPU", 6, 1.5, 2, 0.5),
             MakePlan("ZeRO-2 + optimizer on CPU", 3, 0, 1, 1), MakePlan("ZeRO-1", 12, 1, 0, 0)};
  r.rejected = {{"ZeRO-0 (DDP)", "needs 1697.2 GiB per GPU, has 76.0 usable of 80.0"}};
  return r;
}

TEST_CASE("svg: a standalone, well-formed SVG 1.1 document") {
  const std::string svg = PlansSvg(ThreePlans(), TestCluster(), TestJob(), 5);
  CHECK_MESSAGE(CheckWellFormed(svg).empty(), CheckWellFormed(svg));
  CHECK(svg.find("xmlns=\"http://www.w3.org/2000/svg\" version=\"1.1\"") != std::string::npos);
  CHECK(svg.find(" viewBox=\"0 0 ") != std::string::npos);
  CHECK(svg.rfind("</svg>\n") == svg.size() - 7);
  for (const char* external : {"<script", "<style", "href", "url(", "@import", "<image"}) {
    CHECK_MESSAGE(svg.find(external) == std::string::npos, external);
  }
  CHECK(svg.find("llama-2-70b") != std::string::npos);
  CHECK(svg.find("predictions from memplan&#39;s model") != std::string::npos);

  // The checker itself catches what it is there for.
  CHECK_FALSE(CheckWellFormed(svg.substr(0, svg.size() - 7)).empty());
  std::string unclosed = svg;
  unclosed.replace(unclosed.find("</g>"), 4, "");
  CHECK_FALSE(CheckWellFormed(unclosed).empty());
  std::string bare = svg;
  bare.replace(bare.find("&#39;"), 5, "&");
  CHECK_FALSE(CheckWellFormed(bare).empty());
}

TEST_CASE("svg: one group per plan, up to top, with the plan's family") {
  const PlanResult r = ThreePlans();
  const std::string svg = PlansSvg(r, TestCluster(), TestJob(), 2);
  REQUIRE(CheckWellFormed(svg).empty());
  CHECK(Count(svg, "class=\"plan\"") == 2);
  for (size_t i = 0; i < 2; ++i) {
    const std::string group = Element(svg, "plan-" + std::to_string(i + 1));
    REQUIRE_FALSE(group.empty());
    CAPTURE(group);
    CHECK(FamilyText(group) == "#" + std::to_string(i + 1) + " " + r.plans[i].family);
    CHECK(group.find("<title>#" + std::to_string(i + 1) + " " + r.plans[i].family) !=
          std::string::npos);
    CHECK(group.find("micro-batch 2 x grad-accum 4") != std::string::npos);
    CHECK(group.find(" tokens/s") != std::string::npos);
    for (const char* tier : {"gpu", "cpu", "pinned", "nvme"}) {
      CHECK(!Element(group, "plan-" + std::to_string(i + 1) + "-" + tier).empty());
    }
  }
  CHECK(svg.find("ZeRO-1<") == std::string::npos);  // the third plan is not drawn
  CHECK(Element(svg, "plan-3").empty());
  CHECK(Count(PlansSvg(r, TestCluster(), TestJob(), 10), "class=\"plan\"") == 3);
  CHECK(Count(PlansSvg(r, TestCluster(), TestJob(), 0), "class=\"plan\"") == 1);
}

TEST_CASE("svg: step-time segments are stacked in proportion to the split, on one scale") {
  const PlanResult r = ThreePlans();
  const std::string svg = PlansSvg(r, TestCluster(), TestJob(), 3);
  REQUIRE(CheckWellFormed(svg).empty());
  const char* keys[] = {"compute", "comm", "offload", "optimizer"};
  std::vector<double> totals_px;
  for (size_t i = 0; i < r.plans.size(); ++i) {
    const StepTime& t = r.plans[i].time;
    const double seconds[] = {t.compute_s, t.exposed_comm_s, t.exposed_offload_s,
                              t.exposed_optimizer_s};
    double total_px = 0, below = 0;
    for (size_t k = 0; k < 4; ++k) {
      const std::string rect = Element(svg, "plan-" + std::to_string(i + 1) + "-" + keys[k]);
      REQUIRE_MESSAGE(!rect.empty(), std::string(keys[k]));
      const double y = Number(rect, "y"), h = Number(rect, "height");
      // Stacked: each segment sits on the one before it.
      if (k > 0) CHECK(std::fabs(y + h - below) < 0.011);
      below = y;
      total_px += h;
    }
    for (size_t k = 0; k < 4; ++k) {
      const double h =
          Number(Element(svg, "plan-" + std::to_string(i + 1) + "-" + keys[k]), "height");
      CAPTURE(std::string(keys[k]));
      CHECK(std::fabs(h / total_px - seconds[k] / t.total_s) < 1e-3);
    }
    totals_px.push_back(total_px);
  }
  // One time scale: the tallest bar is the slowest plan's, the others in proportion.
  CHECK(std::fabs(totals_px[2] - 190) < 0.05);
  CHECK(std::fabs(totals_px[0] / totals_px[2] - 10.0 / 13.0) < 1e-3);
  CHECK(std::fabs(totals_px[1] / totals_px[2] - 5.0 / 13.0) < 1e-3);
}

TEST_CASE("svg: memory over capacity or over the usable limit is marked, unknown capacity said") {
  PlanResult r = ThreePlans();
  r.plans[0].peak.cpu_bytes = 1100 * kGiB;  // over the 1 TiB of RAM
  r.plans[1].peak.gpu_bytes = 78 * kGiB;    // under 80 GiB, over the 76 usable
  std::string svg = PlansSvg(r, TestCluster(), TestJob(), 3);
  REQUIRE(CheckWellFormed(svg).empty());

  const std::string cpu = Element(svg, "plan-1-cpu");
  CHECK(ClassOf(cpu) == "tier over-capacity");
  CHECK(cpu.find("over 1.00 TiB") != std::string::npos);
  CHECK(cpu.find("over capacity</title>") != std::string::npos);
  // The bar rises above the capacity outline, drawn in the warning colour.
  const size_t used_at = cpu.find("class=\"used\"");
  const size_t capacity_at = cpu.find("class=\"capacity\"");
  REQUIRE(used_at != std::string::npos);
  REQUIRE(capacity_at != std::string::npos);
  const std::string used = cpu.substr(cpu.rfind("<rect", used_at));
  const std::string capacity = cpu.substr(cpu.rfind("<rect", capacity_at));
  CHECK(Number(used, "height") > Number(capacity, "height"));
  CHECK(used.substr(0, used.find('>')).find("#e15759") != std::string::npos);

  CHECK(ClassOf(Element(svg, "plan-2-gpu")) == "tier over-limit");
  CHECK(Element(svg, "plan-2-gpu").find("over usable") != std::string::npos);
  for (const char* fine :
       {"plan-1-gpu", "plan-1-pinned", "plan-1-nvme", "plan-2-cpu", "plan-3-gpu", "plan-3-cpu"}) {
    CAPTURE(fine);
    CHECK(ClassOf(Element(svg, fine)) == "tier");
  }

  Cluster unknown = TestCluster();
  unknown.cpu_memory_bytes = 0;
  unknown.nvme_path.clear();
  unknown.nvme_capacity_bytes = 0;
  svg = PlansSvg(r, unknown, TestJob(), 1);
  REQUIRE(CheckWellFormed(svg).empty());
  for (const char* tier : {"plan-1-cpu", "plan-1-pinned", "plan-1-nvme"}) {
    CAPTURE(tier);
    CHECK(ClassOf(Element(svg, tier)) == "tier no-capacity");
    CHECK(Element(svg, tier).find(">no capacity given</text>") != std::string::npos);
  }
  CHECK(ClassOf(Element(svg, "plan-1-gpu")) == "tier");
}

TEST_CASE("svg: user text is escaped, invalid UTF-8 and control characters replaced") {
  Job job = TestJob();
  job.model = "<script>alert('x')</script> & \"friends\" \xff\x01";
  Cluster cluster = TestCluster();
  cluster.nvme_path = "/mnt/a&b<c>";
  PlanResult r = ThreePlans();
  r.plans[0].family = "ZeRO-3 <&> \xc3\xa9";
  const std::string svg = PlansSvg(r, cluster, job, 3);
  CHECK_MESSAGE(CheckWellFormed(svg).empty(), CheckWellFormed(svg));
  CHECK(svg.find("<script") == std::string::npos);
  CHECK(svg.find("&lt;script&gt;alert(&#39;x&#39;)&lt;/script&gt; &amp; &quot;friends&quot; "
                 "\xef\xbf\xbd\xef\xbf\xbd") != std::string::npos);
  CHECK(svg.find('\xff') == std::string::npos);
  CHECK(svg.find('\x01') == std::string::npos);
  CHECK(svg.find("/mnt/a&amp;b&lt;c&gt;") != std::string::npos);
  CHECK(svg.find("ZeRO-3 &lt;&amp;&gt; \xc3\xa9") != std::string::npos);  // é kept

  // A name too long for the title is cut with an ellipsis, between characters, not inside one.
  job.model.clear();
  for (int i = 0; i < 300; ++i) job.model += "\xc3\xa9";
  const std::string long_svg = PlansSvg(r, cluster, job, 3);
  CHECK(CheckWellFormed(long_svg).empty());
  CHECK(long_svg.find("\xc3\xa9\xe2\x80\xa6</text>") != std::string::npos);
  CHECK(long_svg.find("\xef\xbf\xbd") == std::string::npos);
}

TEST_CASE("svg: the same input gives byte-identical output") {
  const PlanResult r = ThreePlans();
  const std::string a = PlansSvg(r, TestCluster(), TestJob(), 3);
  const std::string b = PlansSvg(r, TestCluster(), TestJob(), 3);
  CHECK(a == b);
  PlanResult changed = r;
  changed.plans[1].time.exposed_offload_s += 0.5;
  changed.plans[1].time.total_s += 0.5;
  CHECK(PlansSvg(changed, TestCluster(), TestJob(), 3) != a);
  // Not-a-number times (a broken model) still give numbers, never "nan".
  changed.plans[1].time.exposed_comm_s = std::nan("");
  const std::string odd = PlansSvg(changed, TestCluster(), TestJob(), 3);
  CHECK(CheckWellFormed(odd).empty());
  CHECK(odd.find("nan") == std::string::npos);
}

TEST_CASE("svg: when nothing fits, the picture says so and why") {
  PlanResult r;
  r.seq_len = 2048;
  for (int i = 0; i < 10; ++i) {
    r.rejected.push_back({"family " + std::to_string(i), "reason " + std::to_string(i)});
  }
  const std::string svg = PlansSvg(r, TestCluster(), TestJob(), 5);
  CHECK_MESSAGE(CheckWellFormed(svg).empty(), CheckWellFormed(svg));
  CHECK(svg.find("No configuration fits.") != std::string::npos);
  CHECK(Count(svg, "class=\"plan\"") == 0);
  CHECK(Count(svg, "class=\"rejected\"") == 8);
  for (int i = 0; i < 8; ++i) {
    CHECK(svg.find(">family " + std::to_string(i) + "</text>") != std::string::npos);
    CHECK(svg.find(">reason " + std::to_string(i) + "</text>") != std::string::npos);
  }
  CHECK(svg.find("reason 8") == std::string::npos);
  CHECK(svg.find("and 2 more") != std::string::npos);
  CHECK(svg.find("predictions from memplan&#39;s model") != std::string::npos);
}

}  // namespace
}  // namespace memplan::planner
