// Token stores for suffix decoding (specdec/drafters/suffix.py), built once per machine like the
// kernels and loaded with ctypes (plain C functions: no torch headers, so the build takes ~2 s).
//
// A store holds sequences of token ids one after another in one array, a separator (-1) after
// each closed sequence; the last sequence may still be open (growing). Every position p whose
// token and the one before it belong to one sequence is indexed by that bigram: `head` maps a
// bigram to its latest position and `back[p]` is the distance to the previous position with the
// same bigram (0: none), so the occurrences of a bigram are walked newest first; single tokens
// are chained the same way (`head1`, `back1`). The oldest sequence can be evicted (positions
// before `live` are dead: walks stop there); dead space is given back once it is half the array.
// Memory: 4 bytes of token + 8 of links per position, the bigram table (16 bytes a slot, at most
// half full) and 8 bytes per token id.
//
// sd_speculate(context), over several stores pooled: the occurrences of the context's last two
// tokens (where none occurs, of its last token), each with its match length (how far back it
// agrees with the context, up to max_depth). For each distinct match length, longest first, a
// tree of what followed the occurrences at least that long, grown best first by path
// probability (SuffixDecoding, Oliaro et al.): a node's probability is its parent's times the
// share of the parent's occurrences that continue with its token (occurrences that end with
// their sequence count in the share's denominator); nodes are added while the best candidate's
// probability is at least min_prob, up to min(max_nodes, alpha * match length + offset). The tree
// with the highest sum of probabilities (expected accepted tokens) wins, over the stores pooled and
// over the first n_own of them alone (a row's own). An occurrence at the last
// position of an open sequence (a row's own context: nothing follows it yet) is skipped. Ties:
// more occurrences first, then the newest occurrence first, then the candidate found first.
// tests/suffix_reference.py states the same rule by brute force.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <deque>
#include <queue>
#include <vector>

namespace {

constexpr int32_t SEP = -1;
constexpr uint64_t EMPTY = ~0ull;

inline uint64_t mix(uint64_t x) {  // splitmix64's finaliser
    x ^= x >> 30;
    x *= 0xbf58476d1ce4e5b9ull;
    x ^= x >> 27;
    x *= 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

inline uint64_t bigram(int32_t a, int32_t b) {
    return (static_cast<uint64_t>(static_cast<uint32_t>(a)) << 32) | static_cast<uint32_t>(b);
}

// open addressing, linear probing: bigram -> latest position; never deletes a key (a rebuild drops dead ones)
struct HeadMap {
    std::vector<uint64_t> keys;
    std::vector<int64_t> vals;
    size_t used = 0;

    HeadMap() { reset(64); }
    void reset(size_t cap) {
        keys.assign(cap, EMPTY);
        vals.assign(cap, -1);
        used = 0;
    }
    size_t slot(uint64_t k) const {
        size_t m = keys.size() - 1, i = mix(k) & m;
        while (keys[i] != EMPTY && keys[i] != k) i = (i + 1) & m;
        return i;
    }
    int64_t get(uint64_t k) const {
        size_t i = slot(k);
        return keys[i] == k ? vals[i] : -1;
    }
    int64_t put(uint64_t k, int64_t v) {  // the old value (-1: none)
        if ((used + 1) * 2 > keys.size()) rehash(keys.size() * 2, -1);
        size_t i = slot(k);
        int64_t old = -1;
        if (keys[i] == k) old = vals[i];
        else { keys[i] = k; used++; }
        vals[i] = v;
        return old;
    }
    void rehash(size_t cap, int64_t live) {  // to `cap` slots, dropping keys whose latest position is < live
        std::vector<uint64_t> ok;
        std::vector<int64_t> ov;
        ok.swap(keys);
        ov.swap(vals);
        reset(cap);
        for (size_t i = 0; i < ok.size(); i++)
            if (ok[i] != EMPTY && ov[i] >= live) {
                size_t j = slot(ok[i]);
                keys[j] = ok[i];
                vals[j] = ov[i];
                used++;
            }
    }
    size_t bytes() const { return keys.capacity() * sizeof(uint64_t) + vals.capacity() * sizeof(int64_t); }
};

struct Store {
    int64_t base = 0;            // absolute position of tok[0]
    int64_t live = 0;            // first live position
    std::vector<int32_t> tok;    // tokens, SEP after each closed sequence
    std::vector<uint32_t> back;  // distance to the previous position with the same bigram (0: none)
    std::vector<uint32_t> back1; // distance to the previous position of the same token (0: none)
    HeadMap head;
    std::vector<int64_t> head1;  // per token id: its latest position (-1: none)
    std::deque<int64_t> starts;  // first position of each live sequence, oldest first
    bool open = false;           // the last sequence still grows
    int64_t kept = 0;            // tokens of live sequences (separators not counted)

    int64_t end() const { return base + static_cast<int64_t>(tok.size()); }
    int32_t at(int64_t p) const { return tok[p - base]; }
    int64_t prev(int64_t p) const {
        uint32_t d = back[p - base];
        return d ? p - d : -1;
    }
    int64_t prev1(int64_t p) const {
        uint32_t d = back1[p - base];
        return d ? p - d : -1;
    }
    int64_t latest(int32_t t) const { return t < static_cast<int64_t>(head1.size()) ? head1[t] : -1; }

    void push(int32_t t) {  // a token (t >= 0), or SEP: close the open sequence; other values are ignored
        if (t < 0) {
            if (t != SEP) return;
            if (open) {
                tok.push_back(SEP);
                back.push_back(0);
                back1.push_back(0);
                open = false;
            }
            return;
        }
        if (!open) {
            starts.push_back(end());
            open = true;
        }
        int64_t p = end();
        uint32_t d = 0;
        if (p - 1 >= starts.back()) {
            int64_t old = head.put(bigram(at(p - 1), t), p);
            if (old >= 0 && p - old < (1ll << 32)) d = static_cast<uint32_t>(p - old);
        }
        if (t >= static_cast<int64_t>(head1.size())) head1.resize(t + 1, -1);
        int64_t old1 = head1[t];
        head1[t] = p;
        tok.push_back(t);
        back.push_back(d);
        back1.push_back(old1 >= 0 && p - old1 < (1ll << 32) ? static_cast<uint32_t>(p - old1) : 0);
        kept++;
    }

    int64_t evict_oldest() {  // tokens evicted; -1 if the only sequence is open or there is none
        if (starts.empty() || (open && starts.size() == 1)) return -1;
        int64_t start = starts.front();
        starts.pop_front();
        int64_t next = starts.empty() ? end() : starts.front();
        int64_t n = next - start - 1;  // less the separator
        kept -= n;
        live = next;
        int64_t dead = live - base;
        if (dead > 4096 && dead * 2 > static_cast<int64_t>(tok.size())) {
            tok.erase(tok.begin(), tok.begin() + dead);
            back.erase(back.begin(), back.begin() + dead);
            back1.erase(back1.begin(), back1.begin() + dead);
            tok.shrink_to_fit();
            back.shrink_to_fit();
            back1.shrink_to_fit();
            base = live;
            size_t cap = 64;
            while (cap < 2 * std::max<size_t>(head.used, 1)) cap *= 2;
            head.rehash(cap, live);
        }
        return n;
    }

    size_t bytes() const {
        return sizeof(Store) + tok.capacity() * sizeof(int32_t) + (back.capacity() + back1.capacity()) * sizeof(uint32_t) +
               head.bytes() + head1.capacity() * sizeof(int64_t) + starts.size() * sizeof(int64_t);
    }
};

struct Occ {
    const Store* store;
    int64_t pos;  // of the occurrence's last token (at the root), or of a node's token
    int len;      // matched length (at the root)
};

struct Candidate {
    double prob;
    int64_t order;  // tie-break: candidates made earlier first
    int parent;     // output node it hangs under (0 = root)
    int32_t token;
    std::vector<Occ> occ;  // where this node's token sits in the occurrences that reach it
};

struct ByProb {
    const std::vector<Candidate>* all;
    bool operator()(int a, int b) const {  // priority_queue pops the largest: higher prob, then lower order
        const Candidate& x = (*all)[a];
        const Candidate& y = (*all)[b];
        if (x.prob != y.prob) return x.prob < y.prob;
        return x.order > y.order;
    }
};

// The children of a node whose occurrences are `occ` (newest first): per next token, the
// occurrences that continue with it (in occ's order), by count (desc), then by their first
// occurrence in occ.
void children_of(const std::vector<Occ>& occ, std::vector<std::pair<int32_t, std::vector<Occ>>>& out) {
    out.clear();
    std::vector<std::pair<int32_t, int>> next;  // (token, index in occ) of every occurrence that goes on
    next.reserve(occ.size());
    for (size_t i = 0; i < occ.size(); i++) {
        int64_t r = occ[i].pos + 1;
        if (r >= occ[i].store->end()) continue;
        int32_t t = occ[i].store->at(r);
        if (t != SEP) next.emplace_back(t, static_cast<int>(i));
    }
    std::sort(next.begin(), next.end());  // by token, then index
    std::vector<std::pair<int, int>> groups;  // (start in next, end)
    for (size_t i = 0; i < next.size();) {
        size_t j = i;
        while (j < next.size() && next[j].first == next[i].first) j++;
        groups.emplace_back(static_cast<int>(i), static_cast<int>(j));
        i = j;
    }
    std::sort(groups.begin(), groups.end(), [&next](const auto& a, const auto& b) {
        int ca = a.second - a.first, cb = b.second - b.first;
        return ca != cb ? ca > cb : next[a.first].second < next[b.first].second;
    });
    for (const auto& g : groups) {
        std::vector<Occ> members;
        members.reserve(g.second - g.first);
        for (int k = g.first; k < g.second; k++) {
            const Occ& o = occ[next[k].second];
            members.push_back(Occ{o.store, o.pos + 1, 0});
        }
        out.emplace_back(next[g.first].first, std::move(members));
    }
}

// The tree grown best first from the occurrences `occ` (see the file's comment); returns its sum of
// probabilities (the expected accepted tokens if the probabilities hold).
double grow(const std::vector<Occ>& occ, int budget, double min_prob, bool tree, std::vector<int32_t>& tokens,
            std::vector<int32_t>& parents, std::vector<double>& probs) {
    tokens.clear();
    parents.clear();
    probs.clear();
    std::vector<Candidate> cands;
    ByProb cmp{&cands};
    std::priority_queue<int, std::vector<int>, ByProb> heap(cmp);
    std::vector<std::pair<int32_t, std::vector<Occ>>> kids;
    int64_t order = 0;
    auto expand = [&](const std::vector<Occ>& from, double prob, int parent) {
        children_of(from, kids);
        double total = static_cast<double>(from.size());
        for (auto& k : kids) {
            double p = prob * (static_cast<double>(k.second.size()) / total);
            if (p < min_prob) break;  // children come by count: the rest are smaller
            cands.push_back(Candidate{p, order++, parent, k.first, std::move(k.second)});
            heap.push(static_cast<int>(cands.size()) - 1);
            if (!tree) break;
        }
    };
    expand(occ, 1.0, 0);
    double score = 0;
    while (static_cast<int>(tokens.size()) < budget && !heap.empty()) {
        int i = heap.top();
        heap.pop();
        tokens.push_back(cands[i].token);
        parents.push_back(cands[i].parent);
        probs.push_back(cands[i].prob);
        score += cands[i].prob;
        std::vector<Occ> from = std::move(cands[i].occ);
        expand(from, probs.back(), static_cast<int>(tokens.size()));
    }
    return score;
}

// How a draft is made (SuffixParams in suffix.py, field for field) and what it is.
struct Params {
    int32_t max_depth, max_nodes;
    double alpha, offset, min_prob;
    int32_t max_walk, max_occ, lengths, tree;
};

constexpr int MAX_NODES = 64;

struct Result {
    int32_t count, match_len, occurrences;
    int32_t tokens[MAX_NODES];
    int32_t parents[MAX_NODES];  // 0 = root, else the 1-based node
    double probs[MAX_NODES];
};

// The occurrences of the context's last two tokens in `stores` (where none occurs, of its last
// token), each with its match length; longest first, then stores in order, each newest first.
std::vector<Occ> collect(void* const* stores, int n_stores, const int32_t* ctx, int n, const Params& P) {
    std::vector<Occ> found;
    if (n > 1) {
        uint64_t key = bigram(ctx[n - 2], ctx[n - 1]);
        for (int k = 0; k < n_stores; k++) {
            const Store& s = *static_cast<const Store*>(stores[k]);
            int64_t self_end = s.open ? s.end() - 1 : -1;  // the open sequence's last position: nothing follows yet
            int walked = 0;
            for (int64_t p = s.head.get(key); p >= s.live && walked < P.max_walk; p = s.prev(p)) {
                walked++;
                if (p == self_end) continue;
                int len = 2;
                while (len < P.max_depth && len < n && p - len >= s.live && s.at(p - len) == ctx[n - 1 - len]) len++;
                found.push_back(Occ{&s, p, len});
            }
        }
    }
    if (found.empty()) {  // no bigram occurs: the last token alone
        for (int k = 0; k < n_stores; k++) {
            const Store& s = *static_cast<const Store*>(stores[k]);
            int64_t self_end = s.open ? s.end() - 1 : -1;
            int walked = 0;
            for (int64_t p = s.latest(ctx[n - 1]); p >= s.live && walked < P.max_walk; p = s.prev1(p)) {
                walked++;
                if (p != self_end) found.push_back(Occ{&s, p, 1});
            }
        }
    }
    std::stable_sort(found.begin(), found.end(), [](const Occ& a, const Occ& b) { return a.len > b.len; });
    return found;
}

// Into `out`, the best of the trees grown from the occurrences at least as long as each of the
// `lengths` longest distinct match lengths (the highest sum of probabilities; the longer match on
// a tie), where its sum beats *out_score (which it then becomes).
void best_tree(const std::vector<Occ>& found, const Params& P, Result* out, double* out_score) {
    std::vector<int32_t> tokens, parents;
    std::vector<double> probs;
    int tried = 0;
    int cap = std::min(P.max_nodes, MAX_NODES);
    size_t i = 0;
    while (i < found.size() && tried < P.lengths) {
        int len = found[i].len;
        while (i < found.size() && found[i].len == len) i++;  // found[0, i): the occurrences at least len long
        tried++;
        int budget = static_cast<int>(std::min<double>(cap, std::floor(P.alpha * len + P.offset + 1e-9)));
        std::vector<Occ> occ(found.begin(), found.begin() + std::min<size_t>(i, static_cast<size_t>(P.max_occ)));
        double score = budget > 0 ? grow(occ, budget, P.min_prob, P.tree != 0, tokens, parents, probs) : 0.0;
        if (score > *out_score) {
            *out_score = score;
            out->count = static_cast<int32_t>(tokens.size());
            std::copy(tokens.begin(), tokens.end(), out->tokens);
            std::copy(parents.begin(), parents.end(), out->parents);
            std::copy(probs.begin(), probs.end(), out->probs);
            out->match_len = len;
            out->occurrences = static_cast<int32_t>(occ.size());
        }
    }
}

}  // namespace

extern "C" {

void* sd_new() { return new Store(); }
void sd_free(void* s) { delete static_cast<Store*>(s); }

// append tokens to the open sequence (opening one if none); a -1 closes it
void sd_append(void* sp, const int32_t* tokens, int64_t n) {
    Store* s = static_cast<Store*>(sp);
    for (int64_t i = 0; i < n; i++) s->push(tokens[i]);
}

int64_t sd_evict_oldest(void* s) { return static_cast<Store*>(s)->evict_oldest(); }
int64_t sd_tokens(void* s) { return static_cast<Store*>(s)->kept; }
int64_t sd_sequences(void* s) { return static_cast<int64_t>(static_cast<Store*>(s)->starts.size()); }
int64_t sd_bytes(void* s) { return static_cast<int64_t>(static_cast<Store*>(s)->bytes()); }
int64_t sd_open(void* s) { return static_cast<Store*>(s)->open ? 1 : 0; }

// the live sequences as sd_append takes them (each followed by -1 once closed): sd_export_size
// int32 values
int64_t sd_export_size(void* sp) {
    Store* s = static_cast<Store*>(sp);
    return s->end() - s->live;
}
void sd_export(void* sp, int32_t* out) {
    Store* s = static_cast<Store*>(sp);
    if (s->end() > s->live) std::memcpy(out, &s->tok[s->live - s->base], sizeof(int32_t) * (s->end() - s->live));
}

// A draft for `context` (see the file's comment), at most min(max_nodes, MAX_NODES) nodes, from the
// stores pooled and from the first `n_own` of them alone (a row's own context: the cache's counts
// do not dilute what the row itself repeats); the one with the higher sum of probabilities wins,
// the row's own on a tie (Arctic Inference drafts from its local and global trees the same way).
// match_len 0: not even the last token occurs; occurrences: those of the matched suffix the tree
// read. max_walk bounds the occurrences examined per store, max_occ the (newest) occurrences a
// tree reads, lengths the distinct match lengths (longest first) a tree is grown from.
void sd_speculate(void* const* stores, int n_stores, int n_own, const int32_t* ctx, int n, const Params* prm,
                  Result* out) {
    out->count = out->match_len = out->occurrences = 0;
    const Params& P = *prm;
    if (n < 1 || P.max_depth < 2 || ctx[n - 1] < 0 || (n > 1 && ctx[n - 2] < 0)) return;
    double score = -1;
    n_own = std::max(0, std::min(n_own, n_stores));
    if (n_own > 0) best_tree(collect(stores, n_own, ctx, n, P), P, out, &score);
    if (n_own < n_stores) best_tree(collect(stores, n_stores, ctx, n, P), P, out, &score);
}

}  // extern "C"
