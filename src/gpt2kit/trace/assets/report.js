(function(){
'use strict';
var errs=document.getElementById('js-errors');
function report(msg){errs.textContent+=msg+'\n';}
window.addEventListener('error',function(e){report('error: '+e.message+' at '+(e.lineno||'?'));});
window.addEventListener('unhandledrejection',function(e){report('unhandled rejection: '+e.reason);});
// D: what render(data) was last given (report.page_data); T its number of tokens
var D=null,T=0;
function tok(i){var s=D.vocab[String(i)];return s===undefined?'<'+i+'>':s;}
function show(s){return s.replace(/\n/g,'\u21b5').replace(/\t/g,'\u21e5');}
// a label cut to n characters says so (the whole text is in the cell's title)
function short(s,n){s=show(s);return s.length>n?s.slice(0,n-1)+'\u2026':s;}
function el(tag,attrs,text){var e=document.createElement(tag);if(attrs)for(var k in attrs)e.setAttribute(k,attrs[k]);
  if(text!==undefined)e.textContent=text;return e;}
function fmt(x,d){if(x===null||x===undefined)return '\u2013';if(Math.abs(x)>=1e29)return x>0?'+inf':'\u2212inf';
  return Number(x).toPrecision(d||4);}
function pct(p){return (100*p).toFixed(p<0.1?1:0)+'%';}
var tip=document.getElementById('tip');
function tipAt(e,text){tip.textContent=text;tip.style.display='block';
  tip.style.left=Math.min(e.clientX+12,window.innerWidth-320)+'px';tip.style.top=(e.clientY+14)+'px';}
function tipOff(){tip.style.display='none';}

function summary(){
  var c=D.config,S=D.stats,m=S.mean_surprisal_bits,bad=[],old=document.getElementById('nonfinite');
  if(old)old.parentNode.removeChild(old);
  for(var t=0;t<T;t++)if(!S.finite_logits[t])bad.push(t);
  document.getElementById('summary').textContent=(D.model?D.model+' \u2014 ':'')+'L='+c.n_layer+' layers, '+
    c.n_head+' heads, C='+c.n_embd+', V='+c.n_vocab+'; '+T+' tokens'+
    (T<2?'':m===null?'; mean surprisal: none (no position has finite logits)':
      '; mean surprisal '+m.toFixed(2)+' bits/token'+(bad.length?' (over the positions with finite logits)':''));
  if(bad.length)document.querySelector('header').appendChild(el('p',{'class':'warn',id:'nonfinite'},'\u26a0 The logits are '+
    'not finite (NaN or \u00b1inf) at '+bad.length+' of '+T+' positions ('+bad.slice(0,12).join(', ')+
    (bad.length>12?', \u2026':'')+'): what the model predicts there means nothing, and the tokens those positions '+
    'predict are hatched. An intervention, a hook or the weights made them.'));
}

function tokens(){
  var strip=document.getElementById('strip'),S=D.stats;strip.innerHTML='';tipOff();
  for(var t=0;t<=T;t++){
    var last=(t===T),span=el('span',{'class':'tok'},last?' \u25b8 next':show(D.tokens[t]));
    var bits=(t>=1&&!last)?S.surprisal_bits[t-1]:null,bad=t>=1&&!S.finite_logits[t-1];
    if(bad)span.classList.add('nonfinite');
    else if(bits!==null){var a=Math.min(bits/15,1);span.style.background='hsl(0,85%,'+(100-45*a)+'%)';}
    if(last)span.style.color='#07a';
    (function(t,bits,last){span.addEventListener('mousemove',function(e){
      var lines=[];
      if(t===0){lines.push('first token: nothing before it to predict it from');}
      else{var at=t-1;
        if(!S.finite_logits[at])lines.push('the logits at position '+at+' are not finite (NaN or \u00b1inf)');
        if(!last){lines.push('token '+t+': '+JSON.stringify(D.tokens[t])+'  id '+D.ids[t]);
          lines.push('log p = '+fmt(S.next_logprob[at])+' nats, surprisal '+fmt(bits,3)+' bits, rank '+S.next_rank[at]);}
        else lines.push('what the model predicts after the last token');
        lines.push('top predictions at this point:');
        for(var k=0;k<S.top_ids[at].length;k++)lines.push('  '+pct(S.top_probs[at][k]).padStart(6)+'  '+
          JSON.stringify(tok(S.top_ids[at][k])));}
      tipAt(e,lines.join('\n'));});
      span.addEventListener('mouseleave',tipOff);})(t,bits,last);
    strip.appendChild(span);
  }
}

function b64u8(s){var b=atob(s),a=new Uint8Array(b.length);for(var i=0;i<b.length;i++)a[i]=b.charCodeAt(i);return a;}
var ATT=null;
function attMap(li,h){var A=D.attention,n=A.shape[1],off=((li*n)+h)*T*T,out=new Float32Array(T*T);
  if(A.u8){for(var i=0;i<T*T;i++)out[i]=ATT[off+i]/255;}else{var m=A.probs[li][h];
    for(var q=0;q<T;q++)for(var k=0;k<T;k++)out[q*T+k]=m[q][k];}return out;}
function paint(canvas,m,cell){var ctx=canvas.getContext('2d'),img=ctx.createImageData(T,T);
  for(var i=0;i<T*T;i++){var v=m[i],j=4*i;img.data[j]=Math.round(255-215*v);img.data[j+1]=Math.round(255-170*v);
    img.data[j+2]=Math.round(255-60*v);img.data[j+3]=255;}
  if(!cell){ctx.putImageData(img,0,0);return;}
  var tmp=document.createElement('canvas');tmp.width=T;tmp.height=T;tmp.getContext('2d').putImageData(img,0,0);
  return tmp;}
function heads(){
  var box=document.getElementById('heads'),A=D.attention,old=document.getElementById('heads-omitted');
  box.innerHTML='';document.getElementById('head-detail').innerHTML='';if(old)old.parentNode.removeChild(old);
  if(!A){box.textContent='No attention probabilities were recorded (trace with what including probs).';return;}
  if(A.u8)ATT=b64u8(A.u8);
  var nL=A.shape[0],nh=A.shape[1],S=A.summary;
  box.style.gridTemplateColumns='40px repeat('+nh+',72px)';
  box.appendChild(el('div'));for(var h=0;h<nh;h++)box.appendChild(el('div',{'class':'rowlab'},'head '+h));
  for(var li=0;li<nL;li++){
    box.appendChild(el('div',{'class':'rowlab'},'L'+A.layers[li]));
    for(var h2=0;h2<nh;h2++){
      var cell=el('div',{'class':'hcell','data-layer':A.layers[li],'data-head':h2});
      var c=el('canvas',{width:T,height:T});paint(c,attMap(li,h2));cell.appendChild(c);
      var ind=S.induction[li]?S.induction[li][h2]:null;
      cell.appendChild(el('div',null,'p'+fmt(S.prev[li][h2],2)+' f'+fmt(S.first[li][h2],2)+
        (ind!==null?' i'+fmt(ind,2):'')));
      cell.title='block '+A.layers[li]+' head '+h2+': prev '+fmt(S.prev[li][h2],3)+', first '+fmt(S.first[li][h2],3)+
        ', induction '+(ind!==null?fmt(ind,3):'n/a (no repeated token)');
      (function(li,h,cell){cell.addEventListener('click',function(){big(li,h);});})(li,h2,cell);
      box.appendChild(cell);}}
  if(A.omitted&&A.omitted.length)box.parentNode.insertBefore(el('p',{'class':'help',id:'heads-omitted'},'Blocks '+A.omitted.join(', ')+
    ' left out to keep the file small; trace fewer tokens or pick them with --layers.'),box.nextSibling);
  big(Math.min(bigAt[0],nL-1),Math.min(bigAt[1],nh-1));
}
var bigAt=[0,0];  // the map drawn large stays the one chosen when a new text's views are drawn
function big(li,h){
  var A=D.attention,box=document.getElementById('head-detail');box.innerHTML='';bigAt=[li,h];
  var sel=document.querySelectorAll('.hcell.sel');for(var i=0;i<sel.length;i++)sel[i].classList.remove('sel');
  // the outline is found from (block, head), so it always marks the map drawn large
  var cellEl=document.querySelector('.hcell[data-layer="'+A.layers[li]+'"][data-head="'+h+'"]');
  if(cellEl)cellEl.classList.add('sel');
  box.appendChild(el('div',{'class':'help'},'block '+A.layers[li]+', head '+h+' (rows: query, columns: key)'));
  var cell=Math.max(6,Math.min(18,Math.floor(640/T))),pad=110,n=T*cell;
  var c=el('canvas',{width:n+pad,height:n+pad,id:'head-big'}),ctx=c.getContext('2d'),m=attMap(li,h);
  ctx.fillStyle='#fff';ctx.fillRect(0,0,n+pad,n+pad);ctx.imageSmoothingEnabled=false;
  ctx.drawImage(paint(c,m,true),pad,pad,n,n);
  ctx.fillStyle='#333';ctx.font=Math.min(cell,12)+'px monospace';ctx.textBaseline='middle';
  for(var t=0;t<T;t++){var lab=show(D.tokens[t]).slice(0,12);ctx.textAlign='right';
    ctx.fillText(lab,pad-4,pad+t*cell+cell/2);ctx.save();ctx.translate(pad+t*cell+cell/2,pad-4);ctx.rotate(-Math.PI/2);
    ctx.textAlign='left';ctx.fillText(lab,0,0);ctx.restore();}
  c.addEventListener('mousemove',function(e){var r=c.getBoundingClientRect(),x=e.clientX-r.left-pad,y=e.clientY-r.top-pad;
    var k=Math.floor(x/cell),q=Math.floor(y/cell);if(k<0||q<0||k>=T||q>=T){tipOff();return;}
    tipAt(e,'query '+q+' '+JSON.stringify(D.tokens[q])+'\nkey '+k+' '+JSON.stringify(D.tokens[k])+'\np = '+fmt(m[q*T+k],4));});
  c.addEventListener('mouseleave',tipOff);
  box.appendChild(c);
}

function lens(){var box=document.getElementById('lens');box.innerHTML='';
  if(!D.lens){box.textContent='computing the logit lens\u2026';return;}
  lensTable(D.lens,box);}
function lensTable(Ls,box){
  var tbl=el('table',{'class':'lens'}),hr=el('tr');
  hr.appendChild(el('th',null,'layer'));
  for(var t=0;t<T;t++)hr.appendChild(el('th',{title:'position '+t+': '+JSON.stringify(D.tokens[t])},short(D.tokens[t],8)));
  tbl.appendChild(hr);
  for(var r=Ls.layers.length-1;r>=0;r--){
    var tr=el('tr');tr.appendChild(el('th',null,Ls.layers[r]===D.config.n_layer?'H('+Ls.layers[r]+') out':'H('+Ls.layers[r]+')'));
    for(var t2=0;t2<T;t2++){
      var top=Ls.top_ids[r][t2][0],p=Ls.top_probs[r][t2][0],np=t2<T-1?Ls.next_prob[r][t2]:null;
      var td=el('td',null,short(tok(top),9)+'\n'+pct(p));  // token over its probability: narrow columns
      if(np!==null)td.style.background='hsl(140,60%,'+(100-50*Math.min(1,np))+'%)';
      var lines=['layer '+Ls.layers[r]+', position '+t2];
      for(var k=0;k<Ls.top_ids[r][t2].length;k++)lines.push(pct(Ls.top_probs[r][t2][k])+' '+JSON.stringify(tok(Ls.top_ids[r][t2][k])));
      if(np!==null)lines.push('actual next '+JSON.stringify(D.tokens[t2+1])+': '+pct(np)+', rank '+Ls.next_rank[r][t2]);
      td.title=lines.join('\n');tr.appendChild(td);}
    tbl.appendChild(tr);}
  box.appendChild(tbl);
}

function dla(){
  var d=D.dla,box=document.getElementById('dla'),sel=document.getElementById('dla-pos');
  sel.innerHTML='';sel.disabled=!!d.unavailable;
  if(d.unavailable){box.textContent=d.unavailable;return;}
  for(var t=0;t<T;t++){var o=el('option',{value:t},t+': '+show(D.tokens[t]).slice(0,16)+' \u2192 '+show(tok(d.tokens[t])).slice(0,16)+
    (t===T-1?' (top-1)':''));sel.appendChild(o);}
  sel.value=String(T-1);
  function draw(){
    var t=+sel.value,vals=d.values[t],labs=d.labels,L=D.config.n_layer,bars=[],heads=[];
    function v(name){var i=labs.indexOf(name);return i<0?0:vals[i];}
    bars.push(['embed.tok',v('embed.tok')],['embed.pos',v('embed.pos')]);
    for(var i=0;i<L;i++){var a=v('h.'+i+'.attn.bias');
      for(var j=0;j<labs.length;j++)if(labs[j].indexOf('h.'+i+'.attn.head.')===0){a+=vals[j];heads.push([labs[j],vals[j]]);}
      bars.push(['h.'+i+'.attn',a],['h.'+i+'.mlp',v('h.'+i+'.mlp')]);}
    bars.push(['ln_f.bias',v('ln_f.bias')]);
    heads.sort(function(x,y){return Math.abs(y[1])-Math.abs(x[1]);});
    box.innerHTML='';
    var sum=0;for(var s=0;s<vals.length;s++)sum+=vals[s];
    box.appendChild(el('p',{'class':'help'},'logit of '+JSON.stringify(tok(d.tokens[t]))+' at position '+t+' = '+fmt(d.logit[t],5)+
      ' (sum of the pieces: '+fmt(sum,5)+')'));
    var all=bars.concat([['\u2014 largest heads \u2014',null]],heads.slice(0,8));
    var mx=1e-9;for(var b=0;b<all.length;b++)if(all[b][1]!==null)mx=Math.max(mx,Math.abs(all[b][1]));
    for(var b2=0;b2<all.length;b2++){var row=el('div',{'class':'bar'});row.appendChild(el('span',{'class':'lab'},all[b2][0]));
      var tr=el('span',{'class':'track'});
      if(all[b2][1]!==null){var f=el('span',{'class':'fill'}),w=260*Math.abs(all[b2][1])/mx;
        f.style.width=w+'px';f.style.left=(all[b2][1]>=0?260:260-w)+'px';f.style.background=all[b2][1]>=0?'#3a7':'#c54';
        tr.appendChild(f);}
      row.appendChild(tr);row.appendChild(el('span',{'class':'num'},all[b2][1]===null?'':fmt(all[b2][1],3)));box.appendChild(row);}
  }
  sel.onchange=draw;draw();
}

function norms(){
  var N=D.norms,box=document.getElementById('norms'),W=620,H=240,pl=50,pb=30,nL=N.layers.length,mx=1e-9,out=[];
  for(var r=0;r<nL;r++)for(var t=0;t<T;t++)mx=Math.max(mx,N.values[r][t]);
  function X(r){return (pl+(W-pl-10)*(nL>1?r/(nL-1):0.5)).toFixed(1);}
  function Y(v){return (H-pb-(H-pb-10)*v/mx).toFixed(1);}
  out.push('<line x1="'+pl+'" y1="'+(H-pb)+'" x2="'+(W-10)+'" y2="'+(H-pb)+'" stroke="#999"/>');
  out.push('<line x1="'+pl+'" y1="10" x2="'+pl+'" y2="'+(H-pb)+'" stroke="#999"/>');
  var pts=[];
  for(var r2=0;r2<nL;r2++){var m=0;for(var t2=0;t2<T;t2++){m+=N.values[r2][t2];
      out.push('<circle cx="'+X(r2)+'" cy="'+Y(N.values[r2][t2])+'" r="1.6" fill="#9bd"/>');}
    m/=T;pts.push(X(r2)+','+Y(m));
    out.push('<text x="'+X(r2)+'" y="'+(H-pb+14)+'" font-size="10" text-anchor="middle">'+N.layers[r2]+'</text>');}
  out.push('<polyline points="'+pts.join(' ')+'" fill="none" stroke="#07a" stroke-width="2"/>');
  out.push('<text x="4" y="14" font-size="10">'+fmt(mx,3)+'</text>');
  out.push('<text x="'+(W/2)+'" y="'+(H-2)+'" font-size="11" text-anchor="middle">layer l of H(l)</text>');
  box.innerHTML='<svg width="'+W+'" height="'+H+'" viewBox="0 0 '+W+' '+H+'">'+out.join('')+'</svg>';
}

function patch(){
  var P=D.patching,box=document.getElementById('patch');box.innerHTML='';
  if(!P){box.appendChild(el('p',{'class':'help'},'No comparison text was given (gpt2kit trace --compare TEXT or --pairs FILE, '+
    'or trace(..., patch_from=...)).'));return;}
  var what={resid:'one residual vector H(l)[p]',attn:'one block\u2019s attention output at one position',
    mlp:'one block\u2019s MLP output at one position',heads:'one head\u2019s weighted values z (every position)',
    'heads-pos':'one head\u2019s weighted values z at one position'}[P.mode];
  var frac=P.shown==='restored';
  box.appendChild(el('p',{'class':'help',id:'patch-metric'},'Metric: '+P.metric_name+' (clean '+fmt(P.clean_metric,4)+
    ', corrupted '+fmt(P.corrupt_metric,4)+(P.n_pairs>1?'; means over '+P.n_pairs+' pairs':'')+').'));
  if(P.warning)box.appendChild(el('p',{'class':'warn',id:'patch-warning'},'\u26a0 '+P.warning));
  box.appendChild(el('p',{'class':'help',id:'patch-legend'},'The corrupted text runs with '+what+' taken from the clean text. '+
    (frac?'Cell: the fraction of the clean \u2212 corrupted metric difference the patch restores':
      'Cell: the metric\u2019s change m_patched \u2212 m_corrupt')+
    (P.n_pairs>1?' (mean over pairs; hover for the spread)':'')+'. Blank: the two runs agree there, or the effect is under '+
    (frac?P.blank_below:P.blank_below+' of the largest')+' (hover a cell for its value).'+
    (P.mode!=='heads'?' The last position, where the metric is read, stays in view at the right.':'')));
  box.appendChild(patchGrid(P,frac?P.restored:P.change,frac,'patch-grid',P.spread));
  var A=P.attribution;
  if(A){var g=A.agreement;
    box.appendChild(el('p',{'class':'help',id:'patch-attr-help'},'Attribution patching (Nanda 2023): the same cells '+
      'estimated to first order, (a_clean \u2212 a_corrupt) \u00b7 \u2202metric/\u2202a on the corrupted run, from one forward '+
      'and one backward per pair. Agreement with the exact grid over '+g.cells+' cells (metric change): correlation '+
      fmt(g.correlation,3)+', same sign in '+(g.sign_agreement===null?'\u2013':pct(g.sign_agreement))+
      ', largest difference '+fmt(g.max_abs_difference,3)+'.'));
    box.appendChild(patchGrid(P,frac?A.restored_estimate:A.estimate,frac,'patch-attr',null));}
}
function patchGrid(P,V,frac,id,spread){
  var pos=P.mode!=='heads',tbl=el('table',{'class':'lens',id:id}),hr=el('tr');hr.appendChild(el('th',null,''));
  for(var c=0;c<P.columns.length;c++)hr.appendChild(el('th',null,pos?short(D.tokens[c],8)+
    (D.tokens[c]!==P.corrupt_tokens[c]?'\n'+short(P.corrupt_tokens[c],8):''):P.columns[c]));
  tbl.appendChild(hr);
  var mx=1e-12,n=P.columns.length,key=pos?n-1:-1;  // key: the last position, where the metric is read
  if(!frac)for(var a=0;a<V.length;a++)for(var b=0;b<V[a].length;b++)if(V[a][b]!==null)mx=Math.max(mx,Math.abs(V[a][b]));
  var small=frac?P.blank_below:P.blank_below*mx;
  if(key>=0){hr.lastChild.classList.add('key');hr.lastChild.title='position '+key+': the metric is read here';}
  for(var r=P.rows.length-1;r>=0;r--){var tr=el('tr');tr.appendChild(el('th',null,P.rows[r]));
    for(var t2=0;t2<n;t2++){var v=V[r][t2],shown=v!==null&&Math.abs(v)>=small,td=el('td',null,shown?fmt(v,2):'');
      if(t2===key)td.classList.add('key');
      if(shown){var x=Math.max(-1,Math.min(1,frac?v:v/mx));
        td.style.background=x>=0?'hsl(270,60%,'+(100-50*x)+'%)':'hsl(30,80%,'+(100+40*x)+'%)';}
      td.title=P.rows[r]+', '+(pos?'position ':'')+P.columns[t2]+': '+(v===null?'the two runs agree here (not run)':
        !spread?'estimate '+fmt(v,4):(frac?'restored ':'change ')+fmt(v,4)+', patched metric '+fmt(P.metric[r][t2],4)+
        (spread[r][t2]!==null?'; spread over pairs (sd) '+fmt(spread[r][t2],3):''));tr.appendChild(td);}
    tbl.appendChild(tr);}
  var wrap=el('div',{'class':'scroll'});wrap.appendChild(tbl);return wrap;
}

function intervene(){
  var I=D.intervention,box=document.getElementById('intervene');
  if(!I)return;  // the page has no such panel
  box.innerHTML='';
  document.getElementById('summary').textContent+=' \u2014 every panel shows the INTERVENED run; clean vs intervened below.';
  var ul=el('ul');for(var i=0;i<I.interventions.length;i++)ul.appendChild(el('li',null,I.interventions[i]));box.appendChild(ul);
  box.appendChild(el('p',{'class':'help'},'Next-token distribution after the last token, clean vs intervened (the union of '+
    'both top 5). Largest change of any logit anywhere: '+fmt(I.max_abs_logit_change,3)+'.'));
  var t1=el('table',{'class':'lens',id:'intervene-last'}),hr=el('tr');
  ['token','clean','intervened','change'].forEach(function(h){hr.appendChild(el('th',null,h));});t1.appendChild(hr);
  for(var r=0;r<I.last.length;r++){var row=I.last[r],tr=el('tr');tr.appendChild(el('td',null,JSON.stringify(tok(row[0]))));
    tr.appendChild(el('td',null,pct(row[1])));tr.appendChild(el('td',null,pct(row[2])));
    var d=row[2]-row[1],td=el('td',null,(d>=0?'+':'\u2212')+pct(Math.abs(d)));
    td.style.background=d>=0?'hsl(140,60%,88%)':'hsl(0,70%,90%)';tr.appendChild(td);t1.appendChild(tr);}
  box.appendChild(t1);
  box.appendChild(el('p',{'class':'help'},'Per position: KL(clean \u2016 intervened) of the next-token distribution (nats), '+
    'and the log-probability of the token that actually comes next in both runs.'));
  var t2=el('table',{'class':'lens',id:'intervene-pos'}),h2=el('tr');h2.appendChild(el('th',null,''));
  for(var t=0;t<T;t++)h2.appendChild(el('th',{title:'position '+t},short(D.tokens[t],8)));t2.appendChild(h2);
  function line(label,vals,n){var tr=el('tr');tr.appendChild(el('th',null,label));
    for(var t=0;t<T;t++)tr.appendChild(el('td',null,t<n?fmt(vals[t],3):''));t2.appendChild(tr);}
  line('KL',I.kl,T);line('log p clean',I.clean_next_logprob,T-1);line('log p interv.',I.next_logprob,T-1);
  var w2=el('div',{'class':'scroll'});w2.appendChild(t2);box.appendChild(w2);
  box.appendChild(el('p',{'class':'help'},'Logit lens of the clean run (the Logit lens panel above shows the intervened one):'));
  var w3=el('div',{'class':'scroll',id:'intervene-lens'});box.appendChild(w3);lensTable(I.clean_lens,w3);
}

function sae(){
  var S=D.sae,box=document.getElementById('sae');
  if(!S)return;  // the page has no such panel
  box.innerHTML='';
  var l0=0;for(var i=0;i<S.l0.length;i++)l0+=S.l0[i];
  box.appendChild(el('p',{'class':'help',id:'sae-summary'},S.architecture+' SAE, '+S.d_sae+' features, read at '+S.hook_name+
    ' (= '+S.name+(S.centred?', each position centred: its mean over the width removed, as the SAE\u2019s cfg.json asks':'')+
    '): reconstruction MSE '+(S.mse===null?'not finite':fmt(S.mse,3))+' per dimension, fraction of variance explained '+
    (S.fve===null?'\u2013':fmt(S.fve,3))+', mean L0 '+fmt(l0/S.l0.length,3)+' active features per token.'));
  box.appendChild(el('p',{'class':'help'},'The most active features anywhere in the text, each with the tokens that activate it most:'));
  var ul=el('ul',{id:'sae-features'});
  for(var f=0;f<S.features.length;f++){ul.appendChild(el('li',null,'feature '+S.features[f]+': '+
    S.feature_tokens[f].map(function(x){return JSON.stringify(D.tokens[x[0]])+' @'+x[0]+' ('+fmt(x[1],3)+')';}).join(', ')));}
  box.appendChild(ul);
  var tbl=el('table',{'class':'lens',id:'sae-tokens'}),hr=el('tr');
  ['position','token','L0','top features (activation)'].forEach(function(h){hr.appendChild(el('th',null,h));});tbl.appendChild(hr);
  for(var t=0;t<T;t++){var tr=el('tr');tr.appendChild(el('td',null,String(t)));tr.appendChild(el('td',null,short(D.tokens[t],16)));
    tr.appendChild(el('td',null,String(S.l0[t])));var parts=[];
    for(var k=0;k<S.top_ids[t].length;k++)if(S.top_acts[t][k]>0)parts.push(S.top_ids[t][k]+' ('+fmt(S.top_acts[t][k],3)+')');
    tr.appendChild(el('td',null,parts.join('  ')));tbl.appendChild(tr);}
  var w=el('div',{'class':'scroll'});w.appendChild(tbl);box.appendChild(w);
}

var samplingWidget=null;  // made once: the sliders keep their settings from one text to the next
function sampling(){
  var G=D.sampling;if(!G)return;
  if(!samplingWidget)samplingWidget=GPT2Sampling.widget(document.getElementById('sample'),'samp-');
  samplingWidget.set(GPT2Sampling.b64f32(G.logits),function(i){var s=G.vocab[String(i)];return s===undefined?tok(i):s;});
}

function walk(){
  var box=document.getElementById('walk'),cur=null,block=-2;box.innerHTML='';
  document.getElementById('walk-pos').textContent=D.walk_position+' ('+JSON.stringify(D.tokens[D.walk_position])+')';
  for(var i=0;i<D.walk.length;i++){var s=D.walk[i];
    if(s.block!==block){block=s.block;
      if(s.block===null){cur=box;}
      else{var det=el('details');if(s.block===0)det.open=true;
        det.appendChild(el('summary',null,'block '+s.block+' (h.'+s.block+')'));box.appendChild(det);cur=det;}}
    var row=el('div',{'class':'step','data-name':s.name});
    row.appendChild(el('div',{'class':'t'},s.title));
    var eq=el('div',{'class':'eq'});eq.innerHTML=s.eq;row.appendChild(eq);
    row.appendChild(el('div',{'class':'shape'},s.name+'  ('+s.shape.join(', ')+')'));
    var nums;
    if(s.top){nums=s.top.map(function(x){return JSON.stringify(tok(x[0]))+' '+pct(x[1]);}).join('   ');}
    else{nums='['+s.row.first.map(function(x){return s.name==='ids'?String(x):fmt(x,4);}).join(', ')+(s.row.n>s.row.first.length?', \u2026':'')+']'+
      (s.row.norm!==null?'   \u2016row\u2016 = '+fmt(s.row.norm,4):'');}
    row.appendChild(el('div',{'class':'nums'},nums));
    if(s.note){var n=el('div',{'class':'note'});n.innerHTML=s.note;row.appendChild(el('div'));row.appendChild(n);}
    cur.appendChild(row);}
}

var panels=[['summary',summary],['tokens',tokens],['heads',heads],['lens',lens],['dla',dla],['norms',norms],
  ['patch',patch],['sampling',sampling],['intervene',intervene],['sae',sae],['walk',walk]];
function draw(name,fn){try{fn();}catch(e){report(name+': '+(e&&e.stack||e));}}
// Every panel drawn from data (report.page_data); a page made without data (report.views_page) waits for it.
function render(data){
  D=data;T=D.ids.length;
  for(var i=0;i<panels.length;i++)draw(panels[i][0],panels[i][1]);
  document.body.setAttribute('data-rendered',errs.textContent?'with-errors':'ok');
}
// The logit lens sent after the rest (report.lens_data): its panel, and the names of the tokens it shows.
function showLens(data){for(var k in data.vocab)D.vocab[k]=data.vocab[k];D.lens=data.lens;draw('lens',lens);}
window.GPT2Report={render:render,lens:showLens};
var first=JSON.parse(document.getElementById('trace-data').textContent);
if(first)render(first);
})();
